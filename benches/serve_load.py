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


def _args() -> argparse.Namespace:
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
    return p.parse_args()


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


def _make_model(root: Path, args: argparse.Namespace, count: int) -> tuple[Path, list[Path]]:
    """The base model with its tokenizer, and ``count`` random rank-``--rank`` PEFT adapters on q/v
    (one made by PEFT, the others its files with other random tensors)."""
    import safetensors.torch
    import torch

    from lora_pin.fixtures import make_peft_adapter

    base = make_base(root, args)
    first = make_peft_adapter(
        base,
        root / "adapters" / "a0000",
        r=args.rank,
        lora_alpha=2 * args.rank,
        target_modules=["q_proj", "v_proj"],
        seed=1,
    )
    tensors = safetensors.torch.load_file(first / "adapter_model.safetensors")
    config = (first / "adapter_config.json").read_text()
    generator = torch.Generator().manual_seed(args.seed)
    dirs = [first]
    for i in range(1, count):
        folder = root / "adapters" / f"a{i:04d}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(config)
        fresh = {k: torch.randn(v.shape, generator=generator) * 0.02 for k, v in tensors.items()}
        safetensors.torch.save_file(fresh, folder / "adapter_model.safetensors")
        dirs.append(folder)
    return base, dirs


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
        "req/s": len(workload) / wall,
        "tok/s": tokens / wall,
        "ttft p50": _pct(ttft, 50),
        "ttft p99": _pct(ttft, 99),
        "tpot p50": _pct(tpot, 50),
        "tpot p99": _pct(tpot, 99),
        "pinned ttft p99": _pct(pinned_ttft, 99),
        **{k: after[k] - before[k] for k in after},
        "host reads / adapter": (after["host loads"] - before["host loads"]) / max(1, len(named)),
    }


def _shared_prefix(args: argparse.Namespace) -> int:
    """The shared-system-prompt workload, prefix caching on and off (module docs)."""
    root = Path(tempfile.mkdtemp(prefix="serve_load-prefix-"))
    t0 = time.perf_counter()
    base, dirs = _make_model(root, args, args.shared_adapters)
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


def main() -> int:
    args = _args()
    if args.shared_prefix:
        return _shared_prefix(args)
    counts = [int(c) for c in args.adapter_counts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="serve_load-"))
    t0 = time.perf_counter()
    base, dirs = _make_model(root, args, max(counts))
    names = [d.name for d in dirs]
    print(
        f"# model hidden {args.hidden}, {args.layers} layers; {len(dirs)} adapters of rank {args.rank} "
        f"made in "
        f"{time.perf_counter() - t0:.0f} s",
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
    lora_flags = [
        *engine,
        "--lora-paths",
        *startup[: args.host // 2],
        "--max-loras-per-batch",
        str(args.slots),
        "--max-loaded-loras",
        str(args.host),
        "--max-lora-rank",
        str(args.rank),
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "--allow-runtime-lora-updating",
        "--lora-root",
        str(root / "adapters"),
    ]
    results: dict[str, dict[str, Any]] = {}
    # tok/s of each adapter count's runs, in order.
    runs: dict[int, list[float]] = {}
    plain = _Server(engine, args.threads, root / "plain.log")
    try:
        warm = _workload(args, 0, names)[:8]
        asyncio.run(_drive(plain, warm, set()))
        results["LoRA off"] = asyncio.run(_drive(plain, _workload(args, 0, names), set()))
    finally:
        plain.stop()
    lora = _Server(lora_flags, args.threads, root / "lora.log")
    try:
        for n, d in list(zip(names, dirs, strict=True))[args.host // 2 :]:
            lora.post("/load_lora_adapter", {"lora_name": n, "lora_path": str(d)})
        asyncio.run(_drive(lora, _workload(args, 1, names)[:8], set(pinned)))
        for run, count in enumerate(counts):
            label = f"{count} adapters" if counts.count(count) == 1 else f"{count} adapters (run {run + 1})"
            results[label] = asyncio.run(_drive(lora, _workload(args, count, names), set(pinned)))
            runs.setdefault(count, []).append(results[label]["tok/s"])
    finally:
        lora.stop()
    off = results["LoRA off"]["tok/s"]
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
    ]
    print("| configuration | " + " | ".join(cols) + " | tok/s vs LoRA off |")
    print("| --- " * (len(cols) + 2) + "|")
    for name, r in results.items():
        precise = ("ttft", "tpot", "/ adapter")
        cells = [f"{r[c]:.3f}" if any(p in c for p in precise) else f"{r[c]:.1f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + f" | {r['tok/s'] / off:.2f}x |")
    first = counts[0]
    for count, toks in runs.items():
        if count == first:
            continue
        pairs = [t / f for t, f in zip(toks, runs[first], strict=False)]
        print(
            f"# {count} vs {first} adapters: tok/s ratio median {statistics.median(pairs):.2f}x over "
            f"{len(pairs)} pair(s) ({', '.join(f'{p:.2f}' for p in pairs)})"
        )
    print(
        f"# {args.requests} requests each, {args.rate}/s Gamma(cv={args.cv}) arrivals, {args.popularity}, "
        f"base share {args.base_share}, prompt {args.prompt}, output {args.output}; {args.slots} slots, "
        f"host tier {args.host}; total {time.perf_counter() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
