"""What bounds the page pool's throughput at 512 adapters against 8, in the simulator (issue 37).

``benches/serve_load.py --ranks 8:4,16:2,64:1 --memory-slots 8 --pools pages`` serves 64 requests over
8 and then 512 adapters from a page pool of 60 pages (the memory of 8 rank-64 slots on its model), a
32-adapter host tier, and the server's bound on a step's adapters (the host tier). The issue's goal is
512-adapter throughput at >= 0.95x the 8-adapter one; it measures ~0.89x, and the engine runs ~1.15-1.2x
the steps at 512 for the same tokens. This bench replays serve_load's own workloads (the same seeds,
names, ranks and arrivals) through ``lora_pin._core.simulate`` in decode mode, the model that predicts
serve_load's adapters a step and loads within ~10%, over a grid of pool sizes and host tiers, and prints
for each the engine steps at 8 and at 512 adapters and their ratio (the steps' share of the
throughput ratio, at equal step time), summed over ``--seeds`` workloads.

Each row also gives a lower bound on the steps at 512 from memory alone: every unpinned adapter holds
its pages for at least its longest request's tokens, so the steps are at least the sum over adapters of
(pages x longest request) over the unpinned pages.

Run: ``.venv/bin/python benches/page_limits.py`` (seconds).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_load  # the workload's own generator, beside this file

# A pool with a page for every adapter the workloads name: memory never bounds a step.
UNBOUNDED = 4096


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=6, help="workloads (serve_load's --seed 0..N-1)")
    p.add_argument("--pages", default="60,90,120,none", help="page pools to simulate; none: unbounded")
    p.add_argument("--host", default="32,64", help="host tiers to simulate (adapters)")
    p.add_argument("--step-ms", type=float, default=90.0, help="engine step (serve_load measured 89-92)")
    p.add_argument("--read-ms", type=float, default=20.0, help="an adapter's read from disk")
    p.add_argument("--page-rank", type=int, default=8)
    p.add_argument("--ranks", default="8:4,16:2,64:1")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument(
        "--order",
        default="arrival",
        help="admission orders to simulate, comma-separated: arrival, longest_remaining",
    )
    p.add_argument("--rate", type=float, default=64.0)
    return p


def _workload_args(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """serve_load's defaults for its workload, with ``seed`` and this bench's ranks, rate, requests."""
    defaults = serve_load._args([])
    for key, value in (
        ("seed", seed),
        ("ranks", args.ranks),
        ("rate", args.rate),
        ("requests", args.requests),
    ):
        setattr(defaults, key, value)
    return defaults


def _steps(
    args: argparse.Namespace,
    w_args: argparse.Namespace,
    workload: list[Any],
    pool: tuple[int, int, str],
) -> int:
    """The simulated engine steps of ``workload`` on ``pool``: a page pool of that many pages, a host
    tier of that many adapters, and an admission order."""
    pages, host, order = pool
    from lora_pin._core import simulate

    trace = serve_load.simulated_trace(workload)
    report = simulate(
        trace,
        max_loaded_loras=host,
        policy="lru",
        pins=[n for n in _names()[:2] if n in trace.names],
        batch_size=len(workload),
        step_seconds=args.step_ms / 1000,
        load_ms=args.read_ms,
        decode=True,
        adapter_bytes=1 << 20,
        ranks=serve_load.rank_mix(w_args),
        # The server's bound on a step's adapters without --max-loras-per-batch.
        slots=min(pages, host),
        page_rank=args.page_rank,
        max_lora_memory=pages,
        order=order,
    )
    return int(report["steps"])


def _names() -> list[str]:
    return [f"a{i:04d}" for i in range(512)]


def _memory_bound(
    args: argparse.Namespace, w_args: argparse.Namespace, workload: list[Any], pages: int
) -> float:
    """Steps needed at least for ``workload``'s unpinned adapters to hold their pages for their longest
    request each, in the pages the two pinned adapters leave."""
    names = _names()
    ranks = dict(zip(names, serve_load.adapter_ranks(w_args, names), strict=True))
    pinned = set(names[:2])
    longest: dict[str, int] = {}
    for _, name, _, tokens in workload:
        if name is not None and name not in pinned:
            longest[name] = max(longest.get(name, 0), tokens)
    free = pages - sum(math.ceil(ranks[n] / args.page_rank) for n in pinned)
    demand = sum(math.ceil(ranks[n] / args.page_rank) * t for n, t in longest.items())
    return demand / free


class Row(NamedTuple):
    """One pool of the grid: its pages (``UNBOUNDED``: no bound), host tier and admission order, the
    simulated steps at 8 and at 512 adapters summed over the workloads, and the memory bound on the
    steps at 512 (``None`` for an unbounded pool)."""

    pages: int
    host: int
    order: str
    at8: int
    at512: int
    bound: float | None


def grid(args: argparse.Namespace) -> list[Row]:
    """The simulated steps of every pool of ``--pages`` x ``--host`` x ``--order`` on ``--seeds``
    workloads."""
    pools = [UNBOUNDED if p == "none" else int(p) for p in args.pages.split(",")]
    hosts = [int(h) for h in args.host.split(",")]
    orders = args.order.split(",")
    names = _names()
    workloads = []
    for seed in range(args.seeds):
        w_args = _workload_args(args, seed)
        workloads.append(
            (w_args, serve_load._workload(w_args, 8, names), serve_load._workload(w_args, 512, names))
        )
    rows = []
    for pages in pools:
        bound = (
            None
            if pages == UNBOUNDED
            else sum(_memory_bound(args, w, many, pages) for w, _, many in workloads)
        )
        for host in hosts:
            for order in orders:
                pool = (pages, host, order)
                at8 = sum(_steps(args, w, few, pool) for w, few, _ in workloads)
                at512 = sum(_steps(args, w, many, pool) for w, _, many in workloads)
                rows.append(Row(pages, host, order, at8, at512, bound))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    print(
        f"{args.seeds} workloads of serve_load (seeds 0..{args.seeds - 1}), ranks {args.ranks}, "
        f"page rank {args.page_rank}, step {args.step_ms} ms, read {args.read_ms} ms"
    )
    print("| pages | host tier | order | steps at 8 | steps at 512 | 8 / 512 | memory bound at 512 (steps) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in grid(args):
        label = "unbounded" if r.pages == UNBOUNDED else str(r.pages)
        bound = "-" if r.bound is None else f"{r.bound:.0f}"
        print(f"| {label} | {r.host} | {r.order} | {r.at8} | {r.at512} | {r.at8 / r.at512:.3f} | {bound} |")


if __name__ == "__main__":
    main()
