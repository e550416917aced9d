"""Step times and request latencies when adapter reads are slow: blocking loading against background
loading, with the same workload served with no misses at all as the baseline (issue 17, item 6).

A scheduler loop serves single-step (decode) requests over a tiny Llama: each step takes ``--batch``
requests from the front of a FIFO queue (deferred requests go back to the front, in order; those waiting
for a read do not count) as one packed ``prepare_step``, runs the model on them and finishes. Requests
arrive ``--rate`` a second: a quarter on the base model, most on two pinned ("resident") adapters,
``--cold`` percent on six cold adapters that a host tier of four cannot all hold, so they are evicted and
read again. Every read waits ``--delay-ms`` first (:func:`lora_pin._testing.slow_store`, a stand-in for a
slow disk or network store).

Three configurations, run in turn ``--rounds`` times in one process:

- ``blocking``: ``loading="blocking"``: a step that needs an evicted adapter reads it before it begins;
- ``background``: the default; the scheduler also prefetches its waiting queue in each step;
- ``no misses``: background loading with a host tier that holds every adapter: no read after start-up.

Printed per configuration (the median over rounds of each figure): step time p50/p99 (prepare_step +
forward + finish, over the steps that ran requests), latency p50/p99 of base-model, resident-adapter and
cold-adapter requests (arrival to the end of the step that served them), and background p99 / no-miss
p99: the goal is at most 1.2x.

Run: ``.venv/bin/python benches/async_loading.py`` (``--requests``, ``--rate``, ``--delay-ms``,
``--rounds``, ...).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

HOT = ("hot0", "hot1")
COLD = tuple(f"cold{i}" for i in range(6))
GOAL = 1.2


@dataclass
class Run:
    """What one configuration measured in one round (seconds)."""

    steps: list[float] = field(default_factory=list)
    latency: dict[str, list[float]] = field(default_factory=lambda: {"base": [], "hot": [], "cold": []})
    failed: int = 0
    background_loads: int = 0


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` (nearest rank); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def workload(requests: int, cold_percent: int, seed: int) -> list[str | None]:
    """The adapter of each request, in arrival order: a quarter base model, ``cold_percent`` cold, the rest
    hot."""
    rng = random.Random(seed)
    names: list[str | None] = []
    for _ in range(requests):
        draw = rng.randrange(100)
        if draw < 25:
            names.append(None)
        elif draw < 25 + cold_percent:
            names.append(rng.choice(COLD))
        else:
            names.append(rng.choice(HOT))
    return names


def kind(name: str | None) -> str:
    return "base" if name is None else "hot" if name in HOT else "cold"


def serve(mgr: Any, model: Any, names: list[str | None], rate: float, batch: int, prefetch: bool) -> Run:
    """Serve requests for ``names`` arriving ``rate`` a second (one token each) until all are served.

    Each step takes requests from the front of the queue until ``batch`` of them count: a request the
    last step deferred while its adapter was being read (``Step.loading``) goes along without counting,
    as it costs the step nothing until its read is done. With nothing to run the loop sleeps 1 ms.
    """
    import torch

    run = Run()
    # (name, arrival time, waiting for a read)
    waiting: deque[tuple[str | None, float, bool]] = deque()
    begin = time.perf_counter()
    due = deque((name, begin + i / rate) for i, name in enumerate(names))
    with torch.inference_mode():
        while due or waiting:
            now = time.perf_counter()
            while due and due[0][1] <= now:
                name, arrival = due.popleft()
                waiting.append((name, arrival, False))
            if all(loading for _, _, loading in waiting):
                time.sleep(1e-3)
                if not waiting:
                    continue
            taken: list[tuple[str | None, float, bool]] = []
            counted = 0
            while waiting and counted < batch:
                taken.append(waiting.popleft())
                counted += not taken[-1][2]
            start = time.perf_counter()
            step = mgr.prepare_step([name for name, _, _ in taken], 1)
            try:
                if prefetch:
                    # While the step is active: its own adapters are safe from the room reads make.
                    mgr.prefetch([name for name, _, _ in waiting])
                if step.admitted:
                    model(torch.zeros(1, len(step.admitted), dtype=torch.long))
            finally:
                mgr.finish(step)
            end = time.perf_counter()
            if step.admitted:
                run.steps.append(end - start)
            for i in step.admitted:
                name, arrived, _ = taken[i]
                run.latency[kind(name)].append(end - arrived)
            run.failed += len(step.failed)
            loading = set(step.loading)
            waiting.extendleft((taken[i][0], taken[i][1], i in loading) for i in reversed(step.deferred))
    run.background_loads = mgr.stats()["background_loads"]
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests served per run")
    parser.add_argument("--rate", type=float, default=300.0, help="requests arriving a second")
    parser.add_argument("--batch", type=int, default=8, help="requests a step takes at most")
    parser.add_argument("--cold", type=int, default=10, help="percent of requests on cold adapters")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="wait before every adapter read")
    parser.add_argument("--workers", type=int, default=2, help="background loader threads")
    parser.add_argument("--rounds", type=int, default=3, help="times each configuration runs, in turn")
    parser.add_argument("--hidden", type=int, default=256, help="the tiny Llama's hidden size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    import transformers

    from lora_pin import LoRAManager
    from lora_pin._testing import slow_store
    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    names = workload(args.requests, args.cold, args.seed)
    configs: dict[str, dict[str, Any]] = {
        "blocking": dict(loading="blocking", max_loaded_loras=4),
        "background": dict(loading="background", max_loaded_loras=4),
        "no misses": dict(loading="background", max_loaded_loras=len(HOT) + len(COLD)),
    }
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_llama(root / "base", hidden=args.hidden, intermediate=2 * args.hidden, layers=2)
        maker = transformers.AutoModelForCausalLM.from_pretrained(base)
        paths = {
            name: make_peft_adapter(maker, root / name, r=8, lora_alpha=16, target_modules=targets, seed=i)
            for i, name in enumerate(HOT + COLD)
        }
        for _ in range(args.rounds):
            for config, kwargs in configs.items():
                model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
                items = [{"lora_name": n, "lora_path": str(paths[n]), "pinned": True} for n in HOT]
                mgr = LoRAManager(
                    model,
                    items,
                    max_loras_per_batch=4,
                    max_lora_rank=8,
                    lora_target_modules=targets,
                    load_workers=args.workers,
                    **kwargs,
                )
                for name in COLD:
                    mgr.load(name, paths[name])
                with slow_store(args.delay_ms):
                    background = kwargs["loading"] == "background"
                    run = serve(mgr, model, names, args.rate, args.batch, prefetch=background)
                    mgr.wait_loads(timeout=60)
                mgr.detach()
                runs[config].append(run)
                print(f"  {config}: {len(run.steps)} steps done", file=sys.stderr, flush=True)
    return report(runs, args)


def report(runs: dict[str, list[Run]], args: argparse.Namespace) -> int:
    """Print the table; 0 when background loading met the p99 goal, else 1."""

    def median_ms(config: str, figure: Any) -> float:
        return statistics.median(figure(r) for r in runs[config]) * 1e3

    print(
        f"{args.requests} requests at {args.rate:g}/s ({args.cold}% cold), batch {args.batch}, "
        f"reads delayed {args.delay_ms:g} ms, {args.workers} loader threads; medians of {args.rounds} rounds"
    )
    header = ["config", "steps", "step p50", "step p99"]
    for k in ("base", "hot", "cold"):
        header += [f"{k} p50", f"{k} p99"]
    print(" | ".join(f"{h:>10}" for h in header) + " (ms)")
    for config in runs:
        row = [config, str(round(statistics.median(len(r.steps) for r in runs[config])))]
        for q in (50, 99):
            row.append(f"{median_ms(config, lambda r, q=q: percentile(r.steps, q)):.2f}")
        for k in ("base", "hot", "cold"):
            for q in (50, 99):
                row.append(f"{median_ms(config, lambda r, k=k, q=q: percentile(r.latency[k], q)):.2f}")
        print(" | ".join(f"{c:>10}" for c in row))
    # Per round, against the no-miss run of the same round (run next to it): the machine's load drifts.
    ratios = {
        config: sorted(
            percentile(r.steps, 99) / percentile(base.steps, 99)
            for r, base in zip(runs[config], runs["no misses"], strict=True)
        )
        for config in ("background", "blocking")
    }
    ratio, blocking = (statistics.median(ratios[c]) for c in ("background", "blocking"))
    spread = ", ".join(f"{x:.2f}" for x in ratios["background"])
    loads = statistics.median(r.background_loads for r in runs["background"])
    failed = sum(r.failed for rs in runs.values() for r in rs)
    print(
        f"step p99 against no misses (median of the rounds' ratios): background {ratio:.2f}x "
        f"(rounds: {spread}), blocking {blocking:.2f}x "
        f"(goal: background <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'}); "
        f"{loads:g} background loads a round; {failed} requests failed"
    )
    return 0 if ratio <= GOAL and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
