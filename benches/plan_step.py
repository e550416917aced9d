"""One 256-request scheduler step over 64 adapters and 16 device slots: lora_pin's Rust planner vs the
same rules in plain Python (dicts + OrderedDict, as SGLang and vLLM keep their LoRA caches).

``PythonPlanner`` (``tests/core/planner_model.py``) is also the model the hypothesis stateful test
(tests/core/test_core_stateful.py) checks the Rust registry against, so both sides provably do the same work.

Run: ``.venv/bin/python benches/plan_step.py``
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "core"))

from planner_model import PythonPlanner

from lora_pin._core import LoRARef, LoRARegistry


def workload(seed: int, steps: int, names: list[str]) -> list[list[str | None]]:
    """Steps of 256 requests: 10% base model, the rest zipf-like over the adapters."""
    rng = random.Random(seed)
    top = len(names) - 1
    return [
        [None if rng.random() < 0.1 else names[min(int(rng.paretovariate(1.2)) - 1, top)] for _ in range(256)]
        for _ in range(steps)
    ]


def run(
    planner: PythonPlanner | LoRARegistry, steps: list[list[str | None]], tokens: int | list[int]
) -> float:
    """Seconds per step: plan, read every output the model runner needs, report the loads done (for lora_pin
    one step transaction: ``begin_step``, the loads reported, ``finish_step``)."""
    start = time.perf_counter()
    if isinstance(planner, PythonPlanner):
        for step in steps:
            plan = planner.plan(step, tokens)
            _read(plan)
            for load in plan.loads:
                planner.load_done(load[0])
    else:
        for step in steps:
            plan = planner.begin_step(step, tokens)
            _read(plan)
            ticket = plan.ticket
            for index in range(len(plan.loads)):
                planner.report_load(ticket, index, True)
            planner.finish_step(ticket)
    return (time.perf_counter() - start) / len(steps)


def _read(plan: Any) -> None:
    """Read every output of ``plan`` the model runner needs."""
    _ = (plan.admitted, plan.request_slots, plan.token_perm, plan.seg_indptr, plan.seg_slots, plan.evictions)


def build(kind: str, names: list[str]) -> PythonPlanner | LoRARegistry:
    """64 registered adapters (2 pinned), 16 slots, host tier for 48: some steps read from disk."""
    planner: PythonPlanner | LoRARegistry
    planner = PythonPlanner(16, 48) if kind == "python" else LoRARegistry(16, 48)
    for i, name in enumerate(names):
        ref = LoRARef(name, f"/srv/adapters/{name}", pinned=i < 2)
        if isinstance(planner, PythonPlanner):
            planner.register(ref, rank=8, host_bytes=1 << 20)
        else:
            planner.register(ref, rank=8, host_bytes=1 << 20, device_bytes=1 << 20)
    return planner


def main() -> None:
    """Prints µs per step for both planners and their ratio, with the token counts given as a list
    and as one int (a decode step: every request has one token). Rounds alternate between the
    planners and the best round counts, so a noisy neighbour hurts neither side alone."""
    names = [f"adapter-{i}" for i in range(64)]
    steps = workload(0, 400, names)
    forms: dict[str, int | list[int]] = {"list": [1] * 256, "int": 1}
    planners = {kind: build(kind, names) for kind in ("python", "rust")}
    for planner in planners.values():
        run(planner, steps[:50], forms["list"])
    best: dict[tuple[str, str], float] = {}
    for _ in range(5):
        for kind, planner in planners.items():
            for form, tokens in forms.items():
                t = run(planner, steps, tokens)
                best[kind, form] = min(best.get((kind, form), t), t)
    for form in forms:
        python, rust = best["python", form], best["rust", form]
        print(
            f"num_tokens as {form:>4}: python {python * 1e6:6.1f} µs, lora_pin {rust * 1e6:5.1f} µs per "
            f"256-request step; ratio {python / rust:.1f}x"
        )


if __name__ == "__main__":
    main()
