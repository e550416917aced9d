"""A per-sequence prefill layer's LoRA ops with the step's segments made two ways, in one process: sorted
by slot over every token (``segments_from_slots``, what ``batch()`` did inside the forward before) and
derived by arithmetic from the planner's one-token segments (``StepSegments``, what it does now, with
static shapes for ``torch.compile``). Checks both give the same rows, then times shrink + expand.

Run: ``.venv/bin/python benches/sequence_segments.py`` (``--batch``, ``--length``, ``--hidden``, ``--rank``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)

    import torch

    from lora_pin.model.segments import StepSegments
    from lora_pin.ops import KernelMeta, expand, segments_from_slots, shrink

    torch.set_num_threads(1)
    b, length, hidden, rank, slots = args.batch, args.length, args.hidden, args.rank, args.adapters
    gen = torch.Generator().manual_seed(0)
    seq_slots = torch.randint(0, slots, (b,), generator=gen)
    seq_slots[: max(1, b // 6)] = -1  # some base-model sequences
    seq_slots = seq_slots[torch.randperm(b, generator=gen)]
    derived = StepSegments(segments_from_slots(seq_slots), sequence_slots=seq_slots.long())
    new = derived.for_input(torch.empty(b, length, hidden))
    old = segments_from_slots(torch.repeat_interleave(seq_slots, length))
    a = torch.randn(slots, rank, hidden, generator=gen) * 0.01
    bw = torch.randn(slots, hidden, rank, generator=gen) * 0.01
    ranks = torch.full((slots, 1), rank, dtype=torch.int32)
    scalings = torch.ones(slots, 1)
    x = torch.randn(b * length, hidden, generator=gen)

    def run(seg: object) -> torch.Tensor:
        meta = KernelMeta.for_layer(seg, ranks, scalings, [0, hidden])  # type: ignore[arg-type]
        out = torch.zeros(b * length, hidden)
        expand(out, shrink(x, a, meta), bw, meta)
        return out

    torch.testing.assert_close(run(new), run(old), rtol=1e-5, atol=1e-6)
    best = {"sorted": float("inf"), "derived": float("inf")}
    for _ in range(5):
        for name, seg in (("sorted", old), ("derived", new)):
            start = time.perf_counter()
            for _ in range(args.calls):
                run(seg)
            best[name] = min(best[name], (time.perf_counter() - start) / args.calls * 1e3)
    print(
        f"batch {b} x {length} tokens, hidden {hidden}, rank {rank}, {slots} adapters: segments sorted "
        f"{old.seg_slots.numel()} / derived {new.seg_slots.numel()}; shrink + expand sorted "
        f"{best['sorted']:.2f} ms, derived {best['derived']:.2f} ms ({best['derived'] / best['sorted']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
