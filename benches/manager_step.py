"""What a scheduler step costs in ``LoRAManager`` besides the model: ``prepare_step`` + ``finish`` for a
decode step, against the registry's own step transaction (``begin_step`` + ``finish_step``) on the same
names (the part in Rust), so the ratio is the Python layer's share. All adapters stay resident (no loads),
as in a steady decode loop; no forward pass runs.

Run: ``.venv/bin/python benches/manager_step.py`` (``--requests``, ``--adapters``, ``--slots``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def best_us(fn: Callable[[], object], calls: int, rounds: int = 7) -> float:
    """Best-of-``rounds`` mean microseconds per call."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def interleaved_us(
    fns: Mapping[str, Callable[[], object]], calls: int, rounds: int
) -> dict[str, tuple[float, float]]:
    """``(wall, cpu)``: best-of-``rounds`` mean microseconds per call of each of ``fns``, by the wall clock
    and by this thread's CPU time, the functions taking turns within each round."""
    best = {name: [float("inf"), float("inf")] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            best[name] = [min(best[name][0], wall / calls), min(best[name][1], cpu / calls)]
    return {name: (wall * 1e6, cpu * 1e6) for name, (wall, cpu) in best.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    if args.slots < args.adapters:
        parser.error("--slots must be at least --adapters: the step keeps every adapter resident")

    import transformers

    from lora_pin import LoRAManager
    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_llama(root / "base", layers=2)
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        targets = ["q_proj", "v_proj"]
        paths = [
            make_peft_adapter(model, root / f"a{i}", r=8, lora_alpha=16, target_modules=targets, seed=i)
            for i in range(args.adapters)
        ]
        items = [f"a{i}={path}" for i, path in enumerate(paths)]
        mgr = LoRAManager(model, items, max_loras_per_batch=args.slots)
        # Every fifth request on the base model; the adapters in turn.
        names = [f"a{i % args.adapters}" if i % 5 else None for i in range(args.requests)]
        # The same shifted by 0..4 requests: each batch's arrays differ from the one before.
        batches = [names[k:] + names[:k] for k in range(5)]
        turn = itertools.cycle(batches)
        # Equal names in new str objects, more of them than the binding's name cache holds (1024): what
        # the core costs a loop that makes its name objects anew every step.
        copies = [[None if n is None else "".join(list(n)) for n in names] for _ in range(40)]
        fresh = itertools.cycle(copies)
        reg = mgr.registry

        def manager_step() -> None:
            mgr.finish(mgr.prepare_step(names, 1))

        def manager_changing() -> None:
            mgr.finish(mgr.prepare_step(next(turn), 1))

        def transaction() -> None:
            reg.finish_step(reg.begin_step(names, 1).ticket)

        def transaction_changing() -> None:
            reg.finish_step(reg.begin_step(next(turn), 1).ticket)

        def transaction_new_names() -> None:
            reg.finish_step(reg.begin_step(next(fresh), 1).ticket)

        timed = {
            "manager": manager_step,
            "core": transaction,
            "manager, changing": manager_changing,
            "core, changing": transaction_changing,
            "core, new name objects": transaction_new_names,
        }
        for fn in timed.values():
            fn()  # the first step loads every adapter into a slot
        us = interleaved_us(timed, args.calls, args.rounds)
    print(
        f"{args.requests} requests, {args.adapters} adapters, {args.slots} slots, all resident "
        "(us per step, wall / CPU):"
    )
    for what, ours, core in [
        ("steady batch", "manager", "core"),
        ("changing batch", "manager, changing", "core, changing"),
    ]:
        (wall, cpu), (core_wall, core_cpu) = us[ours], us[core]
        print(
            f"  {what}: LoRAManager.prepare_step + finish {wall:.1f} / {cpu:.1f}; registry begin_step + "
            f"finish_step {core_wall:.1f} / {core_cpu:.1f} ({cpu / core_cpu:.2f}x by CPU time; the core's "
            f"share {100 * core_cpu / cpu:.0f}%)"
        )
    (wall, cpu), (core_wall, core_cpu) = us["core, new name objects"], us["core"]
    print(
        f"  registry begin_step + finish_step, steady batch in new name objects each step {wall:.1f} / "
        f"{cpu:.1f} ({cpu / core_cpu:.2f}x the same objects' CPU time: what the binding's name cache saves)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
