"""``lora-pin serve`` under load, driven by the official ``openai`` async client (issue 25, item 7).

Two servers over the same generated model: LoRA off (the baseline: the same engine with no manager),
and LoRA on with ``--adapters-max`` rank-16 adapters registered (``--slots`` device slots, a host tier of
``--host`` adapters, smaller than the set; two adapters pinned at start-up, the rest loaded over HTTP).
The same workload is then served by the LoRA-off server and by the LoRA server with its requests spread
over the first 1, 8, 64 and 512 adapters (``--adapter-counts``):

- arrivals: Gamma with coefficient of variation ``--cv`` (S-LoRA's; 1 is Poisson) at ``--rate`` a second;
- popularity: ``power:ALPHA`` (S-LoRA's ``np.random.power(alpha)`` over adapter ids; 1 is uniform) or
  ``zipf:S``;
- ``--base-share`` of the requests on the base model; prompt and output lengths uniform in ``--prompt``
  and ``--output`` ranges (greedy decoding, ``ignore_eos`` as the peers' benchmarks do: a fixed length).

Printed per configuration: requests/s, output tokens/s, TTFT and TPOT p50/p99, the pinned adapters' TTFT
p99, the requests deferred and the adapter loads per tier during the run (from ``/metrics``), the host
reads per distinct unpinned adapter the run names (1.0: each read once; more is host-tier thrash), and
the throughput ratio against LoRA off. A count given more than once in ``--adapter-counts`` (say
``8,512,8,512``: alternate them, so the shared machine's drift falls on both) is run again; then each
count's throughput against the first count's is also printed as the median over the runs paired in
order.

Run: ``.venv/bin/python benches/serve_load.py`` (defaults sized for a 2-core CPU in a few minutes: hidden
512, 4 layers; ``--hidden 1024 --layers 8`` is the issue's size, for a machine with room).

``--shared-prefix TOKENS`` runs the shared-system-prompt workload instead (issue 36): every request is
one system prompt of TOKENS tokens and a short user part of its own, over ``--shared-adapters`` adapters
(popularity as above, ``--base-share`` on the base), served by two LoRA servers, prefix caching on and
off (``--no-prefix-caching``). Blocks are shared only among requests with the same adapter weights, so
the hits come from each adapter's repeats. Printed: TTFT and TPOT p50/p99, output tokens/s, the prompt
tokens the cache gave (``/metrics``), and caching's TTFT p50 speed-up.

Mixed ranks and pools at equal memory (issue 37): ``--ranks 8:4,16:2,64:1`` gives each adapter one of
those ranks, drawn by the weights (rank:weight) by the simulator's own rule (a hash of the adapter's
name, ``lora_pin._core.ranks_by_name``), so ``lora-pin simulate --ranks`` and this bench agree on every
adapter's rank; the first adapter of each rank is made by PEFT, the rest are its files with other random
tensors. ``--memory-slots K`` sizes the device tier as the memory of K max-rank slots, and ``--pools
slots,pages`` serves the workload from one LoRA server per pool: ``slots`` is ``--max-loras-per-batch
K``; ``pages`` is ``--page-rank P --max-lora-memory K x (bytes of one max-rank adapter)`` and no
``--max-loras-per-batch``, so the pages (and the host tier, which holds a step's adapters) bound a step,
not a count. Each configuration also prints the engine steps and the adapters per
step (distinct adapters a step used, from ``/metrics``) and the load average after each server; with
``--predict``, ``lora_pin._core.simulate``'s prediction of the same trace (names, arrival order, ranks)
on the same pool beside the measurement, with its relative error (in decode mode, calibrated by the
measured step and read times: ``_prediction``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--host", type=int, default=32, help="host-tier capacity in adapters")
    p.add_argument("--adapter-counts", default="1,8,64,512", help="repeat counts to pair runs: 8,512,8,512")
    p.add_argument("--requests", type=int, default=64, help="requests per configuration")
    p.add_argument("--rate", type=float, default=16.0, help="arrivals a second")
    p.add_argument("--cv", type=float, default=1.0, help="Gamma arrivals' coefficient of variation")
    p.add_argument("--popularity", default="power:0.3", help="power:ALPHA or zipf:S")
    p.add_argument("--base-share", type=float, default=0.2)
    p.add_argument("--prompt", default="16,96", help="prompt length range, tokens")
    p.add_argument("--output", default="8,32", help="output length range, tokens")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-prefix", type=int, default=0, help="run the shared-system-prompt workload")
    p.add_argument("--shared-adapters", type=int, default=64, help="adapters of that workload")
    p.add_argument(
        "--ranks",
        default=None,
        metavar="R:W,...",
        help="mixed ranks drawn by the weights from a hash of each adapter's name, as `lora-pin simulate "
        "--ranks` draws them, e.g. 8:4,16:2,64:1 (default: every adapter --rank)",
    )
    p.add_argument(
        "--memory-slots",
        type=int,
        default=None,
        metavar="K",
        help="device memory of K max-rank slots for every pool (default: --slots slots)",
    )
    p.add_argument("--page-rank", type=int, default=8, help="ranks per page of the pages pool")
    p.add_argument(
        "--pools",
        default="slots",
        help="device pools served in turn: slots, pages (needs --memory-slots), each with /ORDER or not "
        "(the server's --admission-order: arrival, longest-remaining), e.g. pages,pages/longest-remaining",
    )
    p.add_argument("--no-lora-off", action="store_true", help="skip the LoRA-off baseline server")
    p.add_argument(
        "--predict", action="store_true", help="print the simulator's prediction beside each measurement"
    )
    return p.parse_args(argv)


def make_base(root: Path, args: argparse.Namespace) -> Path:
    """The generated Llama of ``--hidden`` and ``--layers`` (heads of 64) with the char tokenizer, in
    ``root / "base"`` (``benches/vllm_load.py`` serves the same model)."""
    from lora_pin.fixtures import make_tiny_llama, save_char_tokenizer

    heads = max(1, args.hidden // 64)
    base = make_tiny_llama(
        root / "base",
        hidden=args.hidden,
        intermediate=args.hidden * 11 // 4,
        layers=args.layers,
        heads=heads,
        kv_heads=heads,
    )
    save_char_tokenizer(base)
    return base


def rank_mix(args: argparse.Namespace) -> list[tuple[int, float]]:
    """``--ranks`` as ``(rank, weight)`` pairs, checked as ``lora-pin simulate --ranks`` checks them
    (``[(--rank, 1.0)]`` when not given).

    Raises:
        SpecError: an item that is not ``RANK`` or ``RANK:WEIGHT`` in range, or a weight of 0.
    """
    if args.ranks is None:
        return [(args.rank, 1.0)]
    from lora_pin.cli.simulate_cmd import _sizes

    mix: list[tuple[int, float]] = _sizes(argparse.Namespace(ranks=args.ranks, host_gib=None))["ranks"]
    return mix


def adapter_ranks(args: argparse.Namespace, names: list[str]) -> list[int]:
    """Each adapter's rank: drawn from ``--ranks`` by the simulator's rule (a hash of the name, so the
    same names get the same ranks in ``lora-pin simulate``), or ``--rank`` for all."""
    from lora_pin._core import ranks_by_name

    return ranks_by_name(names, rank_mix(args))


def _make_model(root: Path, args: argparse.Namespace, count: int) -> tuple[Path, list[Path], list[int]]:
    """The base model with its tokenizer, ``count`` random PEFT adapters on q/v and their ranks
    (:func:`adapter_ranks`; the first adapter of each rank made by PEFT, the others its files with
    other random tensors)."""
    import safetensors.torch
    import torch

    from lora_pin.fixtures import make_peft_adapter

    base = make_base(root, args)
    names = [f"a{i:04d}" for i in range(count)]
    ranks = adapter_ranks(args, names)
    generator = torch.Generator().manual_seed(args.seed)
    # Per rank: the PEFT adapter's tensors and config, the template of that rank's copies.
    templates: dict[int, tuple[dict[str, Any], str]] = {}
    dirs = []
    for i, (name, rank) in enumerate(zip(names, ranks, strict=True)):
        folder = root / "adapters" / name
        if rank not in templates:
            made = make_peft_adapter(
                base,
                folder,
                r=rank,
                lora_alpha=2 * rank,
                target_modules=["q_proj", "v_proj"],
                seed=1 + i,
            )
            tensors = safetensors.torch.load_file(made / "adapter_model.safetensors")
            templates[rank] = (tensors, (made / "adapter_config.json").read_text())
        else:
            tensors, config = templates[rank]
            folder.mkdir(parents=True)
            (folder / "adapter_config.json").write_text(config)
            fresh = {k: torch.randn(v.shape, generator=generator) * 0.02 for k, v in tensors.items()}
            safetensors.torch.save_file(fresh, folder / "adapter_model.safetensors")
        dirs.append(folder)
    return base, dirs, ranks


def adapter_bytes(folder: Path) -> int:
    """The bytes of the adapter's tensors in ``folder`` (what one slot of its rank holds)."""
    import safetensors

    total = 0
    with safetensors.safe_open(folder / "adapter_model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_slice(key)
            shape = t.get_shape()
            numel = 1
            for n in shape:
                numel *= n
            total += numel * _DTYPE_BYTES[t.get_dtype()]
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def pool_pages(args: argparse.Namespace, base: Path, folder: Path, max_rank: int, slot_bytes: int) -> int:
    """The pages the page pool of ``--memory-slots`` max-rank slots' bytes holds on ``base``, as the
    server counts them (a manager over ``base`` with the max-rank adapter at ``folder``; a page is
    ``--page-rank`` ranks of every target's A and B and a few bytes of per-page entries)."""
    import transformers

    from lora_pin import LoRAManager

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    manager = LoRAManager(
        model,
        [f"{folder.name}={folder}"],
        page_rank=args.page_rank,
        max_lora_memory=args.memory_slots * slot_bytes,
        max_lora_rank=max_rank,
    )
    pages: int = manager.stats()["device"]["max_pages"]
    manager.detach()
    return pages


ORDERS = ("arrival", "longest-remaining")


def pool_kind(pool: str) -> tuple[str, str]:
    """``pool`` (``KIND`` or ``KIND/ORDER``, e.g. ``pages/longest-remaining``) as its device pool
    (``slots`` or ``pages``) and the server's ``--admission-order`` (``arrival`` when left out).

    Raises:
        SystemExit: an unknown kind or order.
    """
    kind, _, order = pool.partition("/")
    order = order or "arrival"
    if kind not in ("slots", "pages") or order not in ORDERS:
        raise SystemExit(
            f"--pools: slots or pages, each with /ORDER ({', '.join(ORDERS)}) or not; not {pool!r}"
        )
    return kind, order


def pool_flags(args: argparse.Namespace, pool: str, max_rank: int, slot_bytes: int) -> list[str]:
    """The device-tier flags of ``lora-pin serve`` for ``pool`` (``slots`` or ``pages``, either with
    ``/ORDER``: the admission order) at the memory of ``--memory-slots`` slots of ``max_rank``
    (``slot_bytes`` each; ``--slots`` slots without it). The page pool's steps are bounded by its pages
    and the host tier only, as the server does by default.

    Raises:
        SystemExit: an unknown pool, or ``pages`` without ``--memory-slots``.
    """
    pool, order = pool_kind(pool)
    rank = ["--max-lora-rank", str(max_rank), "--admission-order", order]
    if pool == "slots":
        slots = args.slots if args.memory_slots is None else args.memory_slots
        return [*rank, "--max-loras-per-batch", str(slots)]
    if args.memory_slots is None:
        raise SystemExit("--pools pages: give --memory-slots K (the pool's memory in max-rank slots)")
    # No --max-loras-per-batch: a step holds what the pages fit, up to the host tier (the server's rule).
    memory = str(args.memory_slots * slot_bytes)
    return [*rank, "--page-rank", str(args.page_rank), "--max-lora-memory", memory]


class _Server:
    def __init__(self, flags: list[str], threads: int, log: Path) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("w")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
        cmd = [
            sys.executable,
            "-m",
            "lora_pin",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *flags,
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("server did not start")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(), method="POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.read()

    def counters(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        wanted = {
            "deferred": r"^lora_pin_deferred_requests_total (\S+)",
            "device loads": r'^lora_pin_loads_total\{tier="device"\} (\S+)',
            "host loads": r'^lora_pin_loads_total\{tier="host"\} (\S+)',
            "cached tokens": r"^lora_pin_serve_prefix_cache_hit_tokens_total (\S+)",
            "steps": r"^lora_pin_steps_total (\S+)",
            "device hits": r'^lora_pin_hits_total\{tier="device"\} (\S+)',
            "device misses": r'^lora_pin_misses_total\{tier="device"\} (\S+)',
            "reads": r"^lora_pin_adapter_load_seconds_count (\S+)",
            "read seconds": r"^lora_pin_adapter_load_seconds_sum (\S+)",
        }
        found = {k: re.search(rx, text, re.M) for k, rx in wanted.items()}
        return {k: float(m.group(1)) if m else 0.0 for k, m in found.items()}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._log.close()


def _workload(
    args: argparse.Namespace, adapters: int, names: list[str]
) -> list[tuple[float, str | None, list[int], int]]:
    """``(arrival s, adapter or None, prompt ids, output tokens)`` per request, the same for every
    configuration but for which adapters the requests name."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    shape = 1 / args.cv**2
    gaps = rng.gamma(shape, 1 / (args.rate * shape), args.requests)
    kind, _, value = args.popularity.partition(":")
    if kind == "power":
        ids = np.floor(rng.power(float(value), args.requests) * adapters).astype(int)
    elif kind == "zipf":
        weights = 1 / np.arange(1, adapters + 1) ** float(value)
        ids = rng.choice(adapters, args.requests, p=weights / weights.sum())
    else:
        raise SystemExit(f"--popularity: power:ALPHA or zipf:S, not {args.popularity!r}")
    base = rng.random(args.requests) < args.base_share
    lo_p, hi_p = (int(x) for x in args.prompt.split(","))
    lo_o, hi_o = (int(x) for x in args.output.split(","))
    text = random.Random(args.seed)
    out = []
    clock = 0.0
    for i in range(args.requests):
        clock += float(gaps[i])
        prompt = [text.randrange(32, 127) for _ in range(text.randint(lo_p, hi_p))]
        name = None if base[i] or adapters == 0 else names[int(ids[i]) % adapters]
        out.append((clock, name, prompt, text.randint(lo_o, hi_o)))
    return out


async def _stream(client: Any, name: str | None, prompt: list[int], n: int) -> list[float]:
    """One streamed greedy completion of ``n`` tokens (``ignore_eos``) on adapter ``name`` (None: the
    base model) through the ``openai`` client: when each output token arrived (``perf_counter``)."""
    stamps: list[float] = []
    stream = await client.completions.create(
        model=name or "base",
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].token_ids:
            stamps.extend([time.perf_counter()] * len(chunk.choices[0].token_ids))
    return stamps


def _pct(xs: list[float], q: int) -> float:
    """The ``q``-th percentile of ``xs`` (NaN when empty)."""
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))


async def _drive(server: _Server, workload: list[Any], pinned: set[str]) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    ttft: list[float] = []
    tpot: list[float] = []
    pinned_ttft: list[float] = []
    tokens = 0

    async def one(at: float, name: str | None, prompt: list[int], n: int, start: float) -> None:
        nonlocal tokens
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        stamps = await _stream(client, name, prompt, n)
        tokens += len(stamps)
        ttft.append(stamps[0] - sent)
        if name in pinned:
            pinned_ttft.append(stamps[0] - sent)
        if len(stamps) > 1:
            tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))

    named = {name for _, name, _, _ in workload if name is not None and name not in pinned}
    before = server.counters()
    start = time.perf_counter()
    await asyncio.gather(*(one(*job, start) for job in workload))
    wall = time.perf_counter() - start
    after = server.counters()
    await client.close()

    return {
        "wall": wall,
        "req/s": len(workload) / wall,
        "tok/s": tokens / wall,
        "ttft p50": _pct(ttft, 50),
        "ttft p99": _pct(ttft, 99),
        "tpot p50": _pct(tpot, 50),
        "tpot p99": _pct(tpot, 99),
        "pinned ttft p99": _pct(pinned_ttft, 99),
        **{k: after[k] - before[k] for k in after},
        "host reads / adapter": (after["host loads"] - before["host loads"]) / max(1, len(named)),
        # A use is one adapter in one step: the device tier counts each as a hit or a miss.
        "adapters / step": sum(after[k] - before[k] for k in ("device hits", "device misses"))
        / max(1.0, after["steps"] - before["steps"]),
    }


def _shared_prefix(args: argparse.Namespace) -> int:
    """The shared-system-prompt workload, prefix caching on and off (module docs)."""
    root = Path(tempfile.mkdtemp(prefix="serve_load-prefix-"))
    t0 = time.perf_counter()
    base, dirs, _ = _make_model(root, args, args.shared_adapters)
    names = [d.name for d in dirs]
    system = [random.Random(args.seed + 1).randrange(32, 127) for _ in range(args.shared_prefix)]
    workload = [
        (at, name, system + prompt[:16], n) for at, name, prompt, n in _workload(args, len(names), names)
    ]
    page = 32
    # Room for every adapter's cached prompt and the running requests, so caching is never starved.
    blocks = (len(names) + 1 + args.requests) * (args.shared_prefix // page + 2)
    flags = [
        "--model", str(base), "--served-model-name", "base", "--device", "cpu",
        "--max-batch-tokens", str(args.max_batch_tokens), "--num-blocks", str(blocks),
        "--page-size", str(page), "--max-model-len", str(args.shared_prefix + 256),
        "--lora-paths", *[f"{n}={d}" for n, d in zip(names, dirs, strict=True)],
        "--max-loras-per-batch", str(args.slots), "--max-loaded-loras", str(len(names)),
        "--max-lora-rank", str(args.rank), "--lora-target-modules", "q_proj", "v_proj",
    ]  # fmt: skip
    results = {}
    for label, extra in (("prefix caching off", ["--no-prefix-caching"]), ("prefix caching on", [])):
        server = _Server([*flags, *extra], args.threads, root / f"{label.split()[-1]}.log")
        try:
            asyncio.run(_drive(server, workload[:4], set()))
            results[label] = asyncio.run(_drive(server, workload, set()))
        finally:
            server.stop()
    cols = ["tok/s", "ttft p50", "ttft p99", "tpot p50", "tpot p99", "cached tokens"]
    print("| shared system prompt | " + " | ".join(cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    for label, r in results.items():
        cells = [f"{r[c]:.3f}" if "t p" in c else f"{r[c]:.1f}" for c in cols]
        print(f"| {label} | " + " | ".join(cells) + " |")
    on, off = results["prefix caching on"], results["prefix caching off"]
    print(
        f"# TTFT p50 {off['ttft p50'] / on['ttft p50']:.2f}x lower with prefix caching; tok/s "
        f"{on['tok/s'] / off['tok/s']:.2f}x; {args.requests} requests of a {args.shared_prefix}-token system "
        f"prompt + 16 tokens over {len(names)} adapters ({args.popularity}, base share {args.base_share}), "
        f"{args.rate}/s Gamma(cv={args.cv}), output {args.output}; hidden {args.hidden}, {args.layers} "
        f"layers, {args.slots} slots; total {time.perf_counter() - t0:.0f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.shared_prefix:
        return _shared_prefix(args)
    counts = [int(c) for c in args.adapter_counts.split(",")]
    pools = [p.strip() for p in args.pools.split(",")]
    root = Path(tempfile.mkdtemp(prefix="serve_load-"))
    t0 = time.perf_counter()
    base, dirs, ranks = _make_model(root, args, max(counts))
    names = [d.name for d in dirs]
    max_rank = max(ranks)
    slot_bytes = adapter_bytes(dirs[ranks.index(max_rank)])
    pool_args = {pool: pool_flags(args, pool, max_rank, slot_bytes) for pool in pools}
    folder = dirs[ranks.index(max_rank)]
    paged = any(pool_kind(p)[0] == "pages" for p in pools)
    pages = pool_pages(args, base, folder, max_rank, slot_bytes) if paged else 0
    mix = ", ".join(f"{r}: {ranks.count(r)}" for r in sorted(set(ranks)))
    print(
        f"# model hidden {args.hidden}, {args.layers} layers; {len(dirs)} adapters (rank: count {mix}), "
        f"a rank-{max_rank} one {slot_bytes / (1 << 20):.2f} MiB ({pages} pages of rank {args.page_rank} in "
        f"the memory of {args.memory_slots} such slots); made in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    engine = [
        "--model",
        str(base),
        "--served-model-name",
        "base",
        "--device",
        "cpu",
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--num-blocks",
        "512",
        "--page-size",
        "32",
    ]
    pinned = names[:2]
    startup = [
        json.dumps({"lora_name": n, "lora_path": str(d), "pinned": n in pinned})
        for n, d in zip(names, dirs, strict=True)
    ]
    results: dict[str, dict[str, Any]] = {}
    # tok/s of each (pool, adapter count)'s runs, in order.
    runs: dict[tuple[str, int], list[float]] = {}
    if not args.no_lora_off:
        plain = _Server(engine, args.threads, root / "plain.log")
        try:
            warm = _workload(args, 0, names)[:8]
            asyncio.run(_drive(plain, warm, set()))
            results["LoRA off"] = asyncio.run(_drive(plain, _workload(args, 0, names), set()))
        finally:
            plain.stop()
        _print_load("LoRA off")
    for pool in pools:
        lora_flags = [
            *engine,
            "--lora-paths",
            *startup[: args.host // 2],
            *pool_args[pool],
            "--max-loaded-loras",
            str(args.host),
            "--lora-target-modules",
            "q_proj",
            "v_proj",
            "--allow-runtime-lora-updating",
            "--lora-root",
            str(root / "adapters"),
        ]
        lora = _Server(lora_flags, args.threads, root / f"lora-{pool.replace('/', '-')}.log")
        try:
            for n, d in list(zip(names, dirs, strict=True))[args.host // 2 :]:
                lora.post("/load_lora_adapter", {"lora_name": n, "lora_path": str(d)})
            asyncio.run(_drive(lora, _workload(args, 1, names)[:8], set(pinned)))
            for run, count in enumerate(counts):
                label = f"{count} adapters" + ("" if counts.count(count) == 1 else f" (run {run + 1})")
                if len(pools) > 1:
                    label = f"{pool}: {label}"
                results[label] = asyncio.run(_drive(lora, _workload(args, count, names), set(pinned)))
                runs.setdefault((pool, count), []).append(results[label]["tok/s"])
                if args.predict:
                    results[label]["predicted"] = _prediction(
                        args, pool, _workload(args, count, names), pinned, max_rank, slot_bytes,
                        pages, results[label],
                    )  # fmt: skip
        finally:
            lora.stop()
        _print_load(pool)
    _report(args, results, runs, counts)
    print(
        f"# {args.requests} requests each, {args.rate}/s Gamma(cv={args.cv}) arrivals, {args.popularity}, "
        f"base share {args.base_share}, prompt {args.prompt}, output {args.output}; pools "
        f"{'; '.join(p + ': ' + ' '.join(f) for p, f in pool_args.items())}; host tier {args.host}; "
        f"total {time.perf_counter() - t0:.0f} s"
    )
    return 0


def simulated_trace(workload: list[tuple[float, str | None, list[int], int]]) -> Any:
    """``workload`` as the simulator's ``Trace`` in decode mode: per request, in arrival order, its
    adapter (None: the base model), the engine steps it runs (one per output token, the first with its
    prefill) and its arrival time."""
    from lora_pin._core import Trace

    lines = [json.dumps({"adapter": name, "tokens": n, "arrival": at}) for at, name, _, n in workload]
    return Trace.from_jsonl("\n".join(lines), "serve_load")


def _prediction(
    args: argparse.Namespace,
    pool: str,
    workload: list[tuple[float, str | None, list[int], int]],
    pinned: list[str],
    max_rank: int,
    slot_bytes: int,
    pages: int,
    measured: dict[str, Any],
) -> dict[str, float]:
    """What ``lora_pin._core.simulate`` predicts for ``workload`` (the same names in the same arrival
    order, the same ranks: the simulator draws them by the rule :func:`adapter_ranks` used) on ``pool``
    at the server's memory (``pages``: what the page pool's memory holds), pins and host tier: device
    loads, deferrals, adapters per step and engine steps.

    The simulator runs in decode mode, as the engine does: a request runs one step per output token,
    every running request is offered in every step ahead of the waiting ones (the engine offers all
    of them: the batch is the whole workload), and the core defers a running request like a waiting
    one. Calibrated from the measured run: the step clock is its mean step (``wall / steps``), and
    reads from disk take its mean read (``lora_pin_adapter_load_seconds``), off the steps' path as the
    server's background loading does them. The pool's admission order is the simulator's ``order``.
    Not modelled: the engine's token budget and, in arrival order, its order of the waiting requests
    (pinned first, then those that need no load) and the deferral barrier.
    """
    from lora_pin._core import simulate

    trace = simulated_trace(workload)
    pool, order = pool_kind(pool)
    if pool == "pages":
        # The server's bound on a step's adapters without --max-loras-per-batch.
        shape: dict[str, Any] = {"slots": min(pages, args.host), "page_rank": args.page_rank}
        shape["max_lora_memory"] = pages
    else:
        shape = {"slots": args.slots if args.memory_slots is None else args.memory_slots}
    report = simulate(
        trace,
        max_loaded_loras=args.host,
        policy="lru",
        pins=[p for p in pinned if p in trace.names],
        batch_size=len(workload),
        step_seconds=measured["wall"] / max(1.0, measured["steps"]),
        load_ms=1000 * measured["read seconds"] / measured["reads"] if measured["reads"] else 0.0,
        decode=True,
        adapter_bytes=slot_bytes,
        ranks=rank_mix(args),
        order=order.replace("-", "_"),
        **shape,
    )
    return {
        "deferred": report["deferrals"],
        "device loads": report["device"]["misses"],
        "adapters / step": report["uses"] / max(1, report["steps"]),
        "steps": report["steps"],
    }


def _print_predictions(results: dict[str, dict[str, Any]]) -> None:
    """Measured beside predicted, with the relative error of the prediction."""
    cols = ("deferred", "device loads", "adapters / step", "steps")
    print("| configuration | " + " | ".join(f"{c}: measured, simulated, error" for c in cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    for name, r in results.items():
        if "predicted" not in r:
            continue
        cells = []
        for c in cols:
            m, p = r[c], r["predicted"][c]
            error = f"{(p - m) / m:+.0%}" if m else "—"
            cells.append(f"{m:.1f}, {p:.1f}, {error}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def _print_load(after: str) -> None:
    """The machine's load average, printed beside the figures (the box is shared)."""
    one, five, fifteen = os.getloadavg()
    print(f"# load average after {after}: {one:.1f} {five:.1f} {fifteen:.1f}", flush=True)


def _report(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    runs: dict[tuple[str, int], list[float]],
    counts: list[int],
) -> None:
    """The table of every configuration, the paired throughput ratios, with both pools their deferrals
    side by side, and with ``--predict`` the simulator's predictions beside the measurements."""
    off = results["LoRA off"]["tok/s"] if "LoRA off" in results else None
    cols = [
        "req/s",
        "tok/s",
        "ttft p50",
        "ttft p99",
        "tpot p50",
        "tpot p99",
        "pinned ttft p99",
        "deferred",
        "device loads",
        "host loads",
        "host reads / adapter",
        "steps",
        "adapters / step",
    ]
    print("| configuration | " + " | ".join(cols) + " | tok/s vs LoRA off |")
    print("| --- " * (len(cols) + 2) + "|")
    for name, r in results.items():
        precise = ("ttft", "tpot", "/ adapter", "/ step")
        cells = [f"{r[c]:.3f}" if any(p in c for p in precise) else f"{r[c]:.1f}" for c in cols]
        ratio = "—" if off is None else f"{r['tok/s'] / off:.2f}x"
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    first = counts[0]
    for (pool, count), toks in runs.items():
        if count == first:
            continue
        pairs = [t / f for t, f in zip(toks, runs[(pool, first)], strict=False)]
        print(
            f"# {pool}: {count} vs {first} adapters: tok/s ratio median {statistics.median(pairs):.2f}x "
            f"over {len(pairs)} pair(s) ({', '.join(f'{p:.2f}' for p in pairs)})"
        )
    pools = sorted({pool for pool, _ in runs})
    if "slots" in pools and "pages" in pools:
        for count in dict.fromkeys(counts):
            deferred = {
                pool: [r["deferred"] for k, r in results.items() if k.startswith(f"{pool}: {count} adapters")]
                for pool in ("slots", "pages")
            }
            slot, page = statistics.median(deferred["slots"]), statistics.median(deferred["pages"])
            print(
                f"# {count} adapters: deferrals median slots {slot:.0f}, pages {page:.0f}: "
                f"{slot / max(page, 1):.1f}x fewer with pages"
            )
    if args.predict:
        _print_predictions(results)


if __name__ == "__main__":
    sys.exit(main())
