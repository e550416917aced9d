"""What a scheduler step costs in ``LoRAManager`` besides the model: ``prepare_step`` + ``finish`` for a
decode step, against the registry's own step transaction (``begin_step`` + ``finish_step``) on the same
names (the part in Rust), so the ratio is the Python layer's share; the separate ``plan`` + ``acquire`` +
``release`` + ``end_step`` calls a step made before the transaction are timed beside it. All adapters stay
resident (no loads), as in a steady decode loop; no forward pass runs.

Run: ``.venv/bin/python benches/manager_step.py`` (``--requests``, ``--adapters``, ``--slots``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.slots < args.adapters:
        parser.error("--slots must be at least --adapters: the step keeps every adapter resident")

    import transformers

    from lora_pin import LoRAManager
    from lora_pin import _testing as protocol
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
        reg = mgr.registry

        def manager_step() -> None:
            mgr.finish(mgr.prepare_step(names, 1))

        def transaction() -> None:
            reg.finish_step(reg.begin_step(names, 1).ticket)

        def separate_calls() -> None:
            plan = protocol.plan(reg, names, 1)
            ids = protocol.acquire(reg, [names[i] for i in plan.admitted])
            protocol.release(reg, ids)
            protocol.end_step(reg)

        manager_step()  # the first step loads every adapter into a slot
        transaction()
        separate_calls()
        ours = best_us(manager_step, args.calls)
        core = best_us(transaction, args.calls)
        separate = best_us(separate_calls, args.calls)
    print(
        f"{args.requests} requests, {args.adapters} adapters, {args.slots} slots, all resident: "
        f"LoRAManager.prepare_step + finish {ours:.1f} us; registry begin_step + finish_step {core:.1f} us "
        f"({ours / core:.2f}x; the core's share {100 * core / ours:.0f}%); "
        f"plan + acquire + release + end_step {separate:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
