"""``lora-pin simulate``: replay a request trace through the Rust planner and report, per tier, what
each eviction policy does for each configuration, beside Belady's offline-optimal bound."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lora_pin._core import (
    MAX_ADAPTER_RANK,
    MAX_ARRIVAL_CV,
    MAX_SLOTS,
    MIN_ARRIVAL_CV,
    Trace,
    simulate,
    simulate_replicas,
)
from lora_pin.args import EVICTION_POLICIES
from lora_pin.cli._plot import MISSING, draw, draw_memory
from lora_pin.errors import SpecError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    """Registers ``simulate`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="replay a request trace: hit rates, loads, evictions and bytes moved per tier and policy",
        description=(
            "Replay a request trace through the same planner the serving manager uses, for every "
            "combination of --slots, --host and --policy, and print per tier the hit rate, loads, "
            "evictions, bytes moved and deferred requests, beside Belady's offline-optimal hit rate for "
            "the same trace and capacity (the limit no online policy can pass). A use is one adapter in "
            "one step; the device hit rate is the share of uses whose adapter was already in a slot."
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--trace",
        metavar="FILE",
        help='JSONL, one request a line: {"adapter": NAME|null, "tokens": N}; a regular file (<= 256 MiB)',
    )
    src.add_argument(
        "--workload",
        default="zipf:1.0",
        help=(
            "generate a trace: zipf:ALPHA, power:ALPHA (S-LoRA), uniform, shifting, bursty or scan "
            "(default %(default)s)"
        ),
    )
    p.add_argument("--adapters", default="128", help="adapters in a generated trace (default %(default)s)")
    p.add_argument("--requests", default="100000", help="requests in a generated trace (default %(default)s)")
    p.add_argument("--seed", default="0", help="seed of a generated trace (default %(default)s)")
    p.add_argument("--batch-size", default="4", help="requests a step takes (default %(default)s)")
    p.add_argument(
        "--slots", default="8,16", help="device slots to sweep, e.g. 4,8,16,32 (default %(default)s)"
    )
    p.add_argument(
        "--host",
        default="none",
        help="host-tier capacities in adapters to sweep; none = unbounded (default none)",
    )
    pins = p.add_mutually_exclusive_group()
    pins.add_argument("--pin", nargs="+", metavar="NAME", default=[], help="adapters to pin")
    pins.add_argument("--pin-top", default="0", metavar="K", help="pin the K most requested adapters")
    p.add_argument(
        "--policy",
        default=",".join(EVICTION_POLICIES),
        help="eviction policies to compare (default %(default)s)",
    )
    p.add_argument("--step-ms", default="20", help="step time for traces with arrivals (default %(default)s)")
    p.add_argument("--adapter-mb", default="32", help="size of every adapter in MiB (default %(default)s)")
    p.add_argument(
        "--adapter-size-from",
        metavar="PATH",
        default=None,
        help=(
            "size every adapter like the PEFT adapter at PATH instead of --adapter-mb: its A and B and, for "
            "a DoRA adapter, its magnitudes and the factors its slot holds (one per output feature)"
        ),
    )
    p.add_argument(
        "--ranks",
        default=None,
        metavar="R[:W],...",
        help=(
            "mixed ranks: each adapter gets one of these ranks, drawn by the weights W (default 1) from a "
            "hash of its name, and a size in proportion (--adapter-mb or --adapter-size-from is then the "
            "largest rank's size, what a slot holds), e.g. 8,16,64 or 8:2,16:1,64:1 (default: one size)"
        ),
    )
    p.add_argument(
        "--host-gib",
        default=None,
        help="bound the host tier in GiB too (besides --host in adapters); default unbounded",
    )
    p.add_argument(
        "--load-ms",
        default="0",
        help=(
            "time a read from disk takes; above 0 the loop runs in background mode (misses deferred and "
            "read off the step path) and reports the requests deferred by fetches and their extra wait; "
            "0 = reads block the step that needs them (default %(default)s)"
        ),
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help=(
            "a request runs its trace's tokens as steps, one token a step, as an engine decodes (running "
            "requests are offered first and hold their adapter); default: a step serves a request whole"
        ),
    )
    p.add_argument(
        "--admission-order",
        default="arrival",
        choices=("arrival", "longest-remaining"),
        help=(
            "the order a step is offered its requests in, as `lora-pin serve --admission-order`: arrival, "
            "or longest-remaining (most tokens left first, running and waiting together; meaningful with "
            "--decode and a trace whose requests carry their output tokens) (default %(default)s)"
        ),
    )
    p.add_argument(
        "--replicas",
        default=None,
        metavar="N[,N...]",
        help=(
            "simulate N replicas behind a router (a list sweeps), each with its own slots, host tier and "
            "pins; reports loads, hit rates and queues per replica and overall"
        ),
    )
    p.add_argument(
        "--router",
        default="random,least-loaded,affinity",
        help=(
            "routers to compare with --replicas: random, least-loaded (ties at random), affinity, or hash "
            "(the adapter's homes however long their queues: placement's most, and its queueing cost) "
            "(default %(default)s)"
        ),
    )
    p.add_argument(
        "--arrival-rate",
        default=None,
        metavar="REQ_PER_S",
        help=(
            "with --replicas: Gamma arrivals at this mean rate (default: 80%% of the cluster's capacity, "
            "replicas * batch size per step); a --trace file keeps its own arrivals unless this is given"
        ),
    )
    p.add_argument(
        "--cv",
        default="1",
        help=(
            f"coefficient of variation of the arrival gaps, {MIN_ARRIVAL_CV:g}..{MAX_ARRIVAL_CV:g} "
            "(default %(default)s)"
        ),
    )
    p.add_argument(
        "--queue-bound",
        default=None,
        help=(
            "with --replicas: queued requests at which affinity spills to the next choice "
            "(default: the batch size)"
        ),
    )
    p.add_argument(
        "--memory-gib",
        default=None,
        metavar="X[,X...]",
        help=(
            "compare a slot pool and a page pool of the same device memory X GiB (a list sweeps): "
            "X / (the largest rank's adapter size) max-rank slots, against X / (page size) pages of "
            "--page-rank ranks, each adapter taking ceil(rank / page rank) pages; replaces --slots"
        ),
    )
    p.add_argument(
        "--page-rank",
        default="8",
        help="ranks per page with --memory-gib (default %(default)s, as S-LoRA and SGLang)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help=(
            "with --replicas: draw loads and hit rates against slots, host tier and replicas per router; "
            "with --memory-gib: loads and hit rate against memory, slot pool beside page pool; into FILE "
            "(.png, .svg, ...; needs the plot extra)"
        ),
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run)


def _int(flag: str, text: str, *, least: int, most: int = 2**63 - 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if not least <= value <= most or not text.strip().lstrip("+").isdigit():
        raise SpecError(f"{flag}: {text!r} is not an integer in {least}..{most}")
    return value


def _number(flag: str, text: str, *, least: float = 0.0, most: float = float("inf")) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not least <= value <= most or value == float("inf"):
        raise SpecError(f"{flag}: {text!r} is not a number in {least:g}..{most:g}")
    return value


def _list(flag: str, text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise SpecError(f"{flag}: {text!r} has an empty item; give a comma-separated list")
    return items


def _trace(args: argparse.Namespace) -> tuple[Trace, dict[str, Any]]:
    if args.trace is not None:
        # The core reads it under the @FILE list's rules: a regular file only, at most 256 MiB.
        try:
            trace = Trace.from_file(args.trace)
        except SpecError as e:
            raise SpecError(f"--trace: {e}") from e
        return trace, {"file": args.trace, "requests": len(trace), "adapters": len(trace.names)}
    adapters = _int("--adapters", args.adapters, least=1, most=2**32 - 1)
    requests = _int("--requests", args.requests, least=0)
    seed = _int("--seed", args.seed, least=0, most=2**64 - 1)
    trace = Trace.generate(args.workload, adapters=adapters, requests=requests, seed=seed)
    return trace, {"workload": args.workload, "requests": requests, "adapters": adapters, "seed": seed}


def _adapter_bytes(args: argparse.Namespace) -> int:
    """The bytes every simulated adapter moves: ``--adapter-mb``, or the adapter at
    ``--adapter-size-from`` measured (no tensor is read).

    Raises:
        SpecError: ``--adapter-mb`` is not a number in range.
        AdapterLoadError: the adapter at ``--adapter-size-from`` cannot be read.
    """
    path = getattr(args, "adapter_size_from", None)
    if path is None:
        return int(_number("--adapter-mb", args.adapter_mb, most=2**43) * (1 << 20))
    import torch

    from lora_pin.weights.reader import open_adapter

    with open_adapter(path, path) as file:
        element = torch.empty((), dtype=file.dtype).element_size()
        factors = sum(p.b_shape[0] for p in file.pairs.values()) if file.config.use_dora else 0
        return file.file_bytes + factors * element


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    """``simulate``'s size arguments from ``--ranks`` and ``--host-gib``: ``ranks`` ((rank, weight)
    pairs) and ``max_host_bytes``.

    Raises:
        SpecError: an item of ``--ranks`` that is not ``RANK`` or ``RANK:WEIGHT``, or a ``--host-gib``
            that is not a number above 0.
    """
    ranks: list[tuple[int, float]] = []
    if args.ranks is not None:
        for item in _list("--ranks", args.ranks):
            rank, _, weight = item.partition(":")
            w = _number("--ranks", weight) if weight else 1.0
            if w == 0:
                raise SpecError(f"--ranks: {item!r} has a weight of 0; give a number above 0")
            ranks.append((_int("--ranks", rank, least=1, most=MAX_ADAPTER_RANK), w))
    host_bytes = None
    if args.host_gib is not None:
        host_bytes = int(_number("--host-gib", args.host_gib, most=2**33) * (1 << 30))
        if host_bytes < 1:
            raise SpecError(f"--host-gib: {args.host_gib!r} is not a number above 0")
    return {"ranks": ranks, "max_host_bytes": host_bytes}


def _policies(args: argparse.Namespace) -> list[str]:
    """``--policy``'s eviction policies, each checked.

    Raises:
        SpecError: a name that is not an eviction policy.
    """
    policies = _list("--policy", args.policy)
    for policy in policies:
        if policy not in EVICTION_POLICIES:
            raise SpecError(
                f"--policy: {policy!r} is not an eviction policy; choose from {', '.join(EVICTION_POLICIES)}"
            )
    return policies


def _pins(args: argparse.Namespace, trace: Trace) -> list[str]:
    """The adapters to pin: ``--pin`` as given, else the ``--pin-top`` most requested of ``trace``."""
    return list(args.pin) or trace.most_requested(_int("--pin-top", args.pin_top, least=0))


def _order(args: argparse.Namespace) -> dict[str, Any]:
    """``simulate``'s ``decode`` and ``order`` from ``--decode`` and ``--admission-order``."""
    return {"decode": args.decode, "order": args.admission_order.replace("-", "_")}


def _rows(args: argparse.Namespace, trace: Trace) -> list[dict[str, Any]]:
    slots = [_int("--slots", s, least=1, most=MAX_SLOTS) for s in _list("--slots", args.slots)]
    hosts = [None if h == "none" else _int("--host", h, least=1) for h in _list("--host", args.host)]
    policies = _policies(args)
    pins = _pins(args, trace)
    batch = _int("--batch-size", args.batch_size, least=1)
    step_seconds = _number("--step-ms", args.step_ms) / 1000
    adapter_bytes = _adapter_bytes(args)
    sizes = _sizes(args)
    load_ms = _number("--load-ms", args.load_ms)
    rows = []
    runs = len(slots) * len(hosts) * len(policies)
    with _Progress(len(trace) * runs) as progress:
        for s in slots:
            for h in hosts:
                for policy in policies:
                    report = simulate(
                        trace,
                        slots=s,
                        max_loaded_loras=h,
                        policy=policy,
                        pins=pins,
                        batch_size=batch,
                        step_seconds=step_seconds,
                        adapter_bytes=adapter_bytes,
                        load_ms=load_ms,
                        progress=progress.served,
                        **_order(args),
                        **sizes,
                    )
                    progress.next_run(len(trace))
                    row = {
                        "slots": s,
                        "max_loaded_loras": h,
                        "pins": pins,
                        "policy": policy,
                        "load_ms": load_ms,
                        **_order(args),
                        **sizes,
                    }
                    rows.append({**row, **report})
    return rows


def _memory_rows(args: argparse.Namespace, trace: Trace) -> list[dict[str, Any]]:
    """Per ``--memory-gib`` value and policy, a slot pool and a page pool of those bytes.

    Raises:
        SpecError: a memory that holds no max-rank slot, a bad ``--page-rank``, or ``--host`` /
            ``--slots`` lists (the pools are sized by memory, the host tier by ``--host`` alone).
    """
    memories = [_number("--memory-gib", m, most=2**33) for m in _list("--memory-gib", args.memory_gib)]
    page_rank = _int("--page-rank", args.page_rank, least=1, most=MAX_ADAPTER_RANK)
    hosts = [None if h == "none" else _int("--host", h, least=1) for h in _list("--host", args.host)]
    if len(hosts) != 1:
        raise SpecError("--memory-gib: give one --host value (the sweep is over memory)")
    policies = _policies(args)
    pins = _pins(args, trace)
    batch = _int("--batch-size", args.batch_size, least=1)
    step_seconds = _number("--step-ms", args.step_ms) / 1000
    adapter_bytes = _adapter_bytes(args)
    sizes = _sizes(args)
    load_ms = _number("--load-ms", args.load_ms)
    # Without --ranks every adapter is rank 16 of adapter_bytes (the core's default).
    largest = max((r for r, _ in sizes["ranks"]), default=16)
    page_bytes = max(1, adapter_bytes * page_rank // largest)
    pools: list[tuple[float, str, dict[str, Any]]] = []
    for gib in memories:
        memory = int(gib * (1 << 30))
        slots, pages = memory // adapter_bytes, min(memory // page_bytes, MAX_SLOTS)
        if slots < 1:
            raise SpecError(
                f"--memory-gib: {gib:g} GiB holds no max-rank slot of {adapter_bytes / (1 << 20):g} MiB; "
                "give more memory"
            )
        slots = min(slots, MAX_SLOTS)
        pools.append((gib, "slots", {"slots": slots}))
        pools.append((gib, "pages", {"slots": pages, "page_rank": page_rank, "max_lora_memory": pages}))
    rows = []
    with _Progress(len(trace) * len(pools) * len(policies)) as progress:
        for gib, pool, shape in pools:
            for policy in policies:
                report = simulate(
                    trace,
                    max_loaded_loras=hosts[0],
                    policy=policy,
                    pins=pins,
                    batch_size=batch,
                    step_seconds=step_seconds,
                    adapter_bytes=adapter_bytes,
                    load_ms=load_ms,
                    progress=progress.served,
                    **_order(args),
                    **shape,
                    **sizes,
                )
                progress.next_run(len(trace))
                steps = report["steps"]
                rows.append(
                    {
                        "memory_gib": gib,
                        "pool": pool,
                        "slots": shape["slots"],
                        "pages": shape.get("max_lora_memory"),
                        "page_rank": shape.get("page_rank"),
                        "max_loaded_loras": hosts[0],
                        "pins": pins,
                        "policy": policy,
                        "load_ms": load_ms,
                        **_order(args),
                        **sizes,
                        **report,
                        "adapters_per_step": report["uses"] / steps if steps else 0.0,
                    }
                )
    return rows


def _memory_table(rows: list[dict[str, Any]]) -> str:
    out: list[str] = []
    header = (
        f"{'pool':<6} {'size':>12} {'policy':<7} {'hit rate':>9} {'loads':>9} {'fewest':>9} {'evictions':>9} "
        f"{'GiB moved':>10} {'deferred':>9} {'worst wait':>10} {'steps':>8} {'adapters/step':>13}"
    )
    current = None
    for r in rows:
        if r["memory_gib"] != current:
            current = r["memory_gib"]
            pins = ", ".join(r["pins"]) or "none"
            out += ["", f"device memory={r['memory_gib']:g} GiB  pinned={pins}", header]
        d, h = r["device"], r["host"]
        size = f"{r['slots']} slots" if r["pool"] == "slots" else f"{r['pages']} x r{r['page_rank']}"
        # Belady's fewest loads: exact for slots, a lower bound for pages (adapters of mixed sizes).
        fewest = f"{'' if r['pool'] == 'slots' else '>='}{d['belady_misses']}"
        out.append(
            f"{r['pool']:<6} {size:>12} {r['policy']:<7} {_pct(d['hit_rate']):>9} {d['misses']:>9} "
            f"{fewest:>9} {d['evictions']:>9} {_gib(d['bytes_moved'] + h['bytes_moved']):>10} "
            f"{r['deferrals']:>9} {r['worst_wait']:>10} {r['steps']:>8} {r['adapters_per_step']:>13.2f}"
        )
    return "\n".join(out[1:]) + "\n"


class _Progress:
    """One bar over every replay of the sweep, drawn on stderr only when it is a terminal and only once
    the sweep has run for a second (short runs stay silent)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        # disable=None: no bar unless stderr is a terminal.
        self._bar = tqdm(
            total=total, unit="req", unit_scale=True, desc="simulate", delay=1.0, leave=False, disable=None
        )
        self._done = 0

    def served(self, served: int) -> None:
        """``simulate``'s callback: ``served`` requests of the current replay are done."""
        self._bar.update(self._done + served - self._bar.n)

    def next_run(self, requests: int) -> None:
        """The current replay, of ``requests`` requests, has finished."""
        self._done += requests

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}"


def _table(rows: list[dict[str, Any]]) -> str:
    out: list[str] = []
    header = (
        f"{'policy':<7} {'hit rate':>9} {'belady':>9} {'gap':>8} {'loads':>9} {'evictions':>9} "
        f"{'GiB moved':>10} {'disk reads':>10} {'belady':>8} {'deferred':>9} {'worst wait':>10}"
    )
    # Background mode: requests deferred by fetches and their extra wait (mean / p99).
    background = any(r["load_ms"] > 0 for r in rows)
    if background:
        header += f" {'by fetch':>9} {'wait ms':>15} {'wait steps':>13}"

    current = None
    for r in rows:
        key = (r["slots"], r["max_loaded_loras"])
        if key != current:
            current = key
            cap = r["max_loaded_loras"]
            host = "unbounded" if cap is None else f"{cap} adapters"
            pins = ", ".join(r["pins"]) or "none"
            out += [
                "",
                f"slots={r['slots']}  host={host}  pinned={pins}  uses={r['uses']}  steps={r['steps']}",
            ]
            out += [header]
        d, h = r["device"], r["host"]
        gap = d["belady_hit_rate"] - d["hit_rate"]
        belady_reads = "-" if h["belady_misses"] is None else str(h["belady_misses"])
        line = (
            f"{r['policy']:<7} {_pct(d['hit_rate']):>9} {_pct(d['belady_hit_rate']):>9} {100 * gap:>6.2f}pp "
            f"{d['misses']:>9} {d['evictions']:>9} {_gib(d['bytes_moved'] + h['bytes_moved']):>10} "
            f"{h['misses']:>10} {belady_reads:>8} {r['deferrals']:>9} {r['worst_wait']:>10}"
        )
        if background:
            f = r["fetch"]
            wait_ms = f"{f['wait_ms_mean']:.1f} / {f['wait_ms_p99']:.1f}"
            wait_steps = f"{f['wait_steps_mean']:.1f} / {f['wait_steps_p99']:.0f}"
            line += f" {f['deferred_requests']:>9} {wait_ms:>15} {wait_steps:>13}"
        out.append(line)
    return "\n".join(out[1:]) + "\n"


ROUTERS = ("random", "least-loaded", "affinity", "hash")


def _cluster_rows(args: argparse.Namespace, trace: Trace, about: dict[str, Any]) -> list[dict[str, Any]]:
    assert args.replicas is not None
    counts = [_int("--replicas", r, least=1, most=1024) for r in _list("--replicas", args.replicas)]
    routers = _list("--router", args.router)
    for router in routers:
        if router not in ROUTERS:
            raise SpecError(f"--router: {router!r} is not a router; choose from {', '.join(ROUTERS)}")
    slots = [_int("--slots", s, least=1, most=MAX_SLOTS) for s in _list("--slots", args.slots)]
    hosts = [None if h == "none" else _int("--host", h, least=1) for h in _list("--host", args.host)]
    policies = _policies(args)
    pins = _pins(args, trace)
    batch = _int("--batch-size", args.batch_size, least=1)
    step_seconds = _number("--step-ms", args.step_ms) / 1000
    adapter_bytes = _adapter_bytes(args)
    sizes = _sizes(args)
    bound = batch if args.queue_bound is None else _int("--queue-bound", args.queue_bound, least=1)
    # Past this range the Gamma shape 1/cv^2 rounds to 0 or infinity, where no gap can be drawn.
    cv = _number("--cv", args.cv, least=MIN_ARRIVAL_CV, most=MAX_ARRIVAL_CV)
    if _number("--load-ms", args.load_ms) > 0:
        raise SpecError("--load-ms: background loading is not modelled with --replicas; leave it at 0")
    rows = []
    for n in counts:
        timed = trace
        if args.arrival_rate is not None or args.trace is None:
            if args.arrival_rate is None:
                rate = 0.8 * n * batch / max(step_seconds, 1e-9)
            else:
                rate = _number("--arrival-rate", args.arrival_rate)
            try:
                timed = trace.with_gamma_arrivals(rate, cv=cv, seed=about.get("seed", 0))
            except SpecError as e:
                given = args.arrival_rate is not None
                source = "--arrival-rate" if given else "the rate from --step-ms and --batch-size"
                raise SpecError(f"{source} ({rate:g} requests/s) with --cv {cv:g}: {e}") from e
            about.setdefault("arrivals", {})[n] = {"rate": rate, "cv": cv}
        for s in slots:
            for h in hosts:
                for policy in policies:
                    for router in routers:
                        report = simulate_replicas(
                            timed,
                            replicas=n,
                            router=router,
                            slots=s,
                            max_loaded_loras=h,
                            policy=policy,
                            pins=pins,
                            batch_size=batch,
                            step_seconds=step_seconds,
                            adapter_bytes=adapter_bytes,
                            queue_bound=bound,
                            **sizes,
                        )
                        reps = report["replicas"]
                        uses = sum(r["uses"] for r in reps)
                        loads = sum(r["device"]["misses"] for r in reps)
                        total = {
                            "loads": loads,
                            "evictions": sum(r["device"]["evictions"] for r in reps),
                            "disk_reads": sum(r["host"]["misses"] for r in reps),
                            "uses": uses,
                            "hit_rate": 0.0 if uses == 0 else (uses - loads) / uses,
                            "queue_mean_max": max(r["queue_mean"] for r in reps),
                            "queue_max": max(r["queue_max"] for r in reps),
                            "utilisation_max": max(r["utilisation"] for r in reps),
                        }
                        rows.append(
                            {
                                "replicas": n,
                                "router": router,
                                "slots": s,
                                "max_loaded_loras": h,
                                "policy": policy,
                                "pins": pins,
                                "queue_bound": bound,
                                **sizes,
                                "overall": total,
                                "clock_steps": report["steps"],
                                "per_replica": reps,
                            }
                        )
    return rows


def _cluster_table(rows: list[dict[str, Any]]) -> str:
    out: list[str] = []
    header = (
        f"{'router':<13} {'loads':>8} {'hit rate':>9} {'evictions':>9} {'disk reads':>10} "
        f"{'queue mean':>10} {'queue max':>9} {'util':>6}"
    )
    current = None
    for r in rows:
        key = (r["replicas"], r["slots"], r["max_loaded_loras"], r["policy"])
        if key != current:
            current = key
            cap = r["max_loaded_loras"]
            host = "unbounded" if cap is None else f"{cap} adapters"
            out += [
                "",
                f"replicas={r['replicas']}  slots={r['slots']}  host={host}  policy={r['policy']}  "
                f"queue bound={r['queue_bound']}  (queue/util: the worst replica)",
                header,
            ]
        t = r["overall"]
        out.append(
            f"{r['router']:<13} {t['loads']:>8} {_pct(t['hit_rate']):>9} {t['evictions']:>9} "
            f"{t['disk_reads']:>10} {t['queue_mean_max']:>10.2f} {t['queue_max']:>9} "
            f"{100 * t['utilisation_max']:>5.1f}%"
        )
        for i, rep in enumerate(r["per_replica"]):
            d = rep["device"]
            out.append(
                f"  replica-{i:<4} {d['misses']:>8} {_pct(d['hit_rate']):>9} {d['evictions']:>9} "
                f"{rep['host']['misses']:>10} {rep['queue_mean']:>10.2f} {rep['queue_max']:>9} "
                f"{100 * rep['utilisation']:>5.1f}%"
            )
    return "\n".join(out[1:]) + "\n"


def run(args: argparse.Namespace) -> int:
    """Prints one table per (slots, host) configuration, or ``--json``; returns 0 (1 when ``--plot`` is
    given and matplotlib is missing, saying which extra to install).

    Raises:
        SpecError: a bad argument (a list item that is not a number, an unknown workload or policy, a pin
            the trace never names or beyond max_loras_per_batch - 1) or an unreadable or malformed trace;
            the CLI prints the message on one line and exits 2.
    """
    if args.memory_gib is not None and args.replicas is not None:
        raise SpecError("--memory-gib: compares one replica's pools; leave out --replicas")
    if args.replicas is not None and (args.decode or args.admission_order != "arrival"):
        raise SpecError("--decode and --admission-order model one engine; leave out --replicas")
    if args.plot is not None:
        if args.replicas is None and args.memory_gib is None:
            raise SpecError("--plot: draws the replica or memory sweep; give --replicas N or --memory-gib X")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.stderr.write(f"lora-pin simulate: {MISSING}\n")
            return 1
    trace, about = _trace(args)
    if args.replicas is not None:
        rows = _cluster_rows(args, trace, about)
        table = _cluster_table
    elif args.memory_gib is not None:
        rows = _memory_rows(args, trace)
        table = _memory_table
    else:
        rows = _rows(args, trace)
        table = _table
    if args.plot is not None:
        try:
            (draw_memory if args.memory_gib is not None else draw)(rows, args.plot)
        except OSError as e:
            raise SpecError(f"--plot: cannot write {args.plot!r}: {e}") from e
    if args.json:
        json.dump({"trace": about, "results": rows}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        name = about.get("file") or about["workload"]
        sys.stdout.write(f"trace: {name}, {about['requests']} requests over {about['adapters']} adapters\n")
        if args.ranks is not None or args.host_gib is not None:
            sizes = rows[0] if rows else {}
            ranks = ", ".join(f"{r}:{w:g}" for r, w in sizes.get("ranks", [])) or "one size"
            cap = sizes.get("max_host_bytes")
            host = "unbounded" if cap is None else f"{cap / (1 << 30):g} GiB"
            sys.stdout.write(f"sizes: ranks {ranks}; host tier in bytes {host}\n")
        if args.decode or args.admission_order != "arrival":
            mode = "one step per token" if args.decode else "a request served whole"
            sys.stdout.write(f"steps: {mode}; admission order {args.admission_order}\n")
        sys.stdout.write(table(rows))
    return 0
