"""Benchmark: the expert LoRA op against a per-(adapter, expert) loop, on one MoE layer's routed rows.

Both run in the same process on the same tensors, the device's own path (the grouped CPU ops, or the
Triton kernels on CUDA), for one expert weight of one layer:

- ``lora_pin``: :func:`lora_pin.ops.expert_segments` (timed: every layer routes differently, so each
  layer sorts its own rows) then :func:`lora_pin.ops.expert_lora_delta_`, rows in token order.
- ``sorted``: the same on rows laid out sorted by (adapter, expert), as ``LoRAExperts`` lays them out
  when it gathers them: every segment is then a run of rows, which the CPU path computes on views.
- ``loop``: for each (adapter, expert) pair in the batch, find its rows with a torch mask, gather,
  ``x @ Aᵀ @ Bᵀ`` at the adapter's rank, scale, add back: what a MoE layer does per expert, done per
  adapter too.

Each case is checked (the two agree) before it is timed; the methods alternate within every round and
the best round counts. Prints the ratios ``loop / lora_pin`` and ``loop / sorted`` (above 1: faster than
the loop).

    python benches/moe_experts.py                     # default table
    python benches/moe_experts.py --device cuda       # the Triton kernels
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping

import torch

from lora_pin._testing import PATTERNS, request_slots
from lora_pin.ops import ExpertMeta, expert_lora_delta_, expert_segments


def loop_baseline(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    row_experts: torch.Tensor,
    ranks: list[list[int]],
    scalings: list[list[float]],
) -> None:
    """One small GEMM pair per (adapter, expert) present, rows found by a mask."""
    experts = len(ranks[0])
    max_rank, width = a.shape[1] // experts, b.shape[1] // experts
    pairs = torch.unique(torch.stack([row_slots, row_experts]), dim=1).t().tolist()
    for slot, expert in pairs:
        if slot < 0:
            continue
        rows = ((row_slots == slot) & (row_experts == expert)).nonzero().squeeze(1)
        rank = ranks[slot][expert]
        a_e = a[slot, expert * max_rank : expert * max_rank + rank]
        b_e = b[slot, expert * width : (expert + 1) * width, :rank]
        out.index_add_(0, rows, (x.index_select(0, rows) @ a_e.t()) @ b_e.t(), alpha=scalings[slot][expert])


def best_times(
    fns: Mapping[str, Callable[[], object]], rounds: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Best seconds of one call of each, over ``rounds`` rounds in which they take turns."""
    for fn in fns.values():
        fn()
    sync()
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            start = time.perf_counter()
            fns[name]()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run_case(
    pattern: str, phase: str, args: argparse.Namespace, gen: torch.Generator
) -> dict[str, float | str | int]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    experts, slots, rank = args.experts, args.slots, args.rank
    requests, tokens = (
        (args.decode_batch, 1) if phase == "decode" else (args.prefill_requests, args.prefill_tokens)
    )
    request = request_slots(pattern, requests, slots, gen, base_fraction=0.125)
    token_slots = request.repeat_interleave(tokens)
    # Each token's top-k distinct experts, as a router picks them.
    scores = torch.rand(token_slots.shape[0], experts, generator=gen)
    row_experts = scores.topk(args.top_k, dim=1).indices.reshape(-1)
    row_slots = token_slots.repeat_interleave(args.top_k)
    rows = row_slots.shape[0]
    a = (torch.randn(slots, experts * rank, args.hidden, generator=gen) * 0.1).to(device, dtype)
    b = (torch.randn(slots, experts * args.out, rank, generator=gen) * 0.1).to(device, dtype)
    slot_ranks = torch.full((slots, experts), rank, dtype=torch.int32, device=device)
    slot_scalings = torch.full((slots, experts), 2.0, dtype=torch.float32, device=device)
    x = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    out = torch.randn(rows, args.out, generator=gen).to(device, dtype)
    row_slots, row_experts = row_slots.to(device), row_experts.to(device)
    ranks, scalings = slot_ranks.tolist(), slot_scalings.tolist()

    def ours(target: torch.Tensor) -> None:
        segments = expert_segments(row_slots, row_experts, experts, args.chunk_size)
        expert_lora_delta_(
            target, x, a, b, ExpertMeta.for_group(segments, slot_ranks, slot_scalings, args.out)
        )

    def loop(target: torch.Tensor) -> None:
        loop_baseline(target, x, a, b, row_slots, row_experts, ranks, scalings)

    order = torch.argsort(torch.where(row_slots >= 0, row_slots * experts + row_experts, -1), stable=True)
    sorted_slots, sorted_experts, sorted_x = row_slots[order], row_experts[order], x[order]

    def ours_sorted(target: torch.Tensor) -> None:
        segments = expert_segments(sorted_slots, sorted_experts, experts, args.chunk_size)
        meta = ExpertMeta.for_group(segments, slot_ranks, slot_scalings, args.out)
        expert_lora_delta_(target, sorted_x, a, b, meta)

    got, got_sorted, want = out.clone(), out[order].clone(), out.clone()
    ours(got)
    ours_sorted(got_sorted)
    loop(want)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_sorted.float(), want[order].float(), atol=tol, rtol=tol)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    work_ours, work_sorted, work_loop = out.clone(), out[order].clone(), out.clone()
    methods = {
        "lora_pin": lambda: ours(work_ours),
        "sorted": lambda: ours_sorted(work_sorted),
        "loop": lambda: loop(work_loop),
    }
    times = best_times(methods, args.rounds, sync)
    return {
        "pattern": pattern,
        "phase": phase,
        "rows": rows,
        "pairs": int(torch.unique(row_slots[row_slots >= 0] * experts + row_experts[row_slots >= 0]).numel()),
        "lora_pin_us": times["lora_pin"] * 1e6,
        "sorted_us": times["sorted"] * 1e6,
        "loop_us": times["loop"] * 1e6,
        "ratio": times["loop"] / times["lora_pin"],
        "ratio_sorted": times["loop"] / times["sorted"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="adapters (device slots) in the batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024, help="the expert weight's input width")
    parser.add_argument("--out", type=int, default=1024, help="one expert's output width")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--prefill-requests", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk_size is None and args.device == "cuda":
        from lora_pin.ops import CUDA_CHUNK_SIZE

        args.chunk_size = CUDA_CHUNK_SIZE
    gen = torch.Generator().manual_seed(0)
    print(
        f"device={args.device} dtype={args.dtype} experts={args.experts} top_k={args.top_k} "
        f"slots={args.slots} rank={args.rank} hidden={args.hidden} out={args.out} "
        f"threads={torch.get_num_threads()}"
    )
    header = f"{'pattern':<10} {'phase':<8} {'rows':>6} {'pairs':>6} {'lora_pin us':>12} {'sorted us':>10}"
    header += f" {'loop us':>10} {'loop/lora_pin':>14} {'loop/sorted':>12}"
    print(header)
    print("-" * len(header))
    ratios: dict[str, list[float]] = {"ratio": [], "ratio_sorted": []}
    for phase in ("decode", "prefill"):
        for pattern in args.patterns.split(","):
            row = run_case(pattern, phase, args, gen)
            for key, values in ratios.items():
                values.append(float(row[key]))
            print(
                f"{row['pattern']:<10} {row['phase']:<8} {row['rows']:>6} {row['pairs']:>6} "
                f"{row['lora_pin_us']:>12.1f} {row['sorted_us']:>10.1f} {row['loop_us']:>10.1f} "
                f"{row['ratio']:>13.2f}x {row['ratio_sorted']:>11.2f}x"
            )
    for key, label in (("ratio", "loop/lora_pin"), ("ratio_sorted", "loop/sorted")):
        geomean = torch.tensor(ratios[key]).log().mean().exp().item()
        print(f"geometric mean {label}: {geomean:.2f}x over {len(ratios[key])} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
