"""``vllm serve`` without and with lora_pin's plugin, and ``lora-pin serve``, on the same requests.

Issues 35 and 36.

One generated Llama (char tokenizer) and ``max(--adapter-counts)`` PEFT adapters of ranks 8 and 16 on
q/k/v/o (two made by PEFT, the rest their files with other random tensors). Each server is started in
turn and serves the LoRA-off workload (every request on the base model) and then the same requests spread
over the first 8, 64 and 512 adapters (Zipf popularity), closed loop at ``--concurrency`` requests in
flight, greedy with ``ignore_eos`` (a fixed output length):

- ``vllm``: ``vllm serve`` as shipped (``VLLM_PLUGINS=""``); LoRA off is the same server without
  ``--enable-lora``, as a user would run it;
- ``vllm+lora_pin``: ``lora-pin vllm-serve`` (the plugin on, as it starts by default: vLLM's compiled
  forward kept with LoRA on), LoRA off likewise (compiled in every server);
- flags after it, each ``+FLAG``: ``+eager`` (``LORA_PIN_VLLM_COMPILE=0``: the model runs eagerly with
  LoRA on, the plugin's default before December 2026), ``+compile`` (``LORA_PIN_VLLM_COMPILE=1``, the
  default said explicitly), ``+rotate`` (``LORA_PIN_VLLM_ROTATE=1``: its scheduler rotates slots among
  adapters instead of draining them; age bound 4 steps); a kind may end in ``@N`` to set the plugin's
  age bound (``LORA_PIN_VLLM_AGE_BOUND``), e.g. ``vllm+lora_pin+rotate+eager@8``;
- ``lora-pin``: ``lora-pin serve`` on transformers' engine (LoRA off: no adapters registered).

``--pinned N`` pins the N most popular adapters (Zipf's first) at start-up in ``vllm+lora_pin``
(``"pinned": true`` in ``--lora-modules``) and ``lora-pin``; vLLM alone has no start-up pins, so its row
shows the same adapters unpinned. ``--rounds N`` runs the servers in turn N times (the shared machine's
drift then falls on each).

Printed per server and configuration: output tokens/s, TTFT p50/p99, TPOT p50/p99, tok/s against that
server's LoRA off, the pinned adapters' TTFT p50/p99, and their TTFT p99 at the most adapters over that at
the fewest.
The workload and the ``lora-pin serve`` client code come from ``benches/serve_load.py``.

Run: ``.venv/bin/python benches/vllm_load.py`` after ``bash scripts/vllm_venv.sh`` (vLLM runs from its
venv). Defaults are sized for a busy 2-core CPU; ``--hidden 1024 --layers 8 --requests 256`` is
REFERENCE §8's workload.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import serve_load  # the workload and lora-pin serve's launcher

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / "target" / "vllm-venv" / "bin" / "python"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--adapter-counts", default="8,64,512")
    p.add_argument("--requests", type=int, default=96, help="requests per configuration")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--popularity", default="zipf:1.0", help="power:ALPHA or zipf:S")
    p.add_argument("--prompt", default="32,32", help="prompt length range, tokens")
    p.add_argument("--output", default="32,32", help="output length range, tokens")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the base model's and adapters' dtype in every server",
    )
    p.add_argument("--slots", type=int, default=8, help="device slots (vLLM --max-loras)")
    p.add_argument("--host", type=int, default=32, help="host-tier adapters (vLLM --max-cpu-loras)")
    p.add_argument(
        "--target-modules",
        default="q_proj,k_proj,v_proj,o_proj",
        help="modules given LoRA buffers in every server (vLLM's --lora-target-modules; 'all': vLLM's "
        "default, every linear layer)",
    )
    p.add_argument("--servers", default="vllm,vllm+lora_pin,lora-pin")
    p.add_argument("--pinned", type=int, default=2, help="the most popular adapters pinned at start-up")
    p.add_argument("--rounds", type=int, default=1, help="servers run in turn this many times")
    p.add_argument("--threads-bind", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--threads", type=int, default=2, help="lora-pin serve's torch threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    # serve_load's workload reads these: every request at once (the closed loop paces them), no base share.
    args.rate, args.cv, args.base_share = 1e9, 1.0, 0.0
    return args


def target_modules(args: argparse.Namespace, default: list[str] | None = None) -> list[str]:
    """``--lora-target-modules`` and ``--target-modules``' names (both servers take the flag); with
    ``all``, no flag (vLLM then gives every linear layer LoRA buffers) or ``default``'s names."""
    names = default if args.target_modules == "all" else args.target_modules.split(",")
    return ["--lora-target-modules", *names] if names else []


def _make_model(root: Path, args: argparse.Namespace, count: int) -> tuple[Path, list[Path]]:
    """The base model (``--dtype``) with its tokenizer, and ``count`` adapters alternating rank 8 and 16."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    from lora_pin.fixtures import make_peft_adapter

    base = serve_load.make_base(root, args)
    model = AutoModelForCausalLM.from_pretrained(base)
    model.to(getattr(torch, args.dtype)).save_pretrained(base)
    templates = []
    for rank in (8, 16):
        folder = make_peft_adapter(
            model,
            root / "adapters" / f"r{rank}",
            r=rank,
            lora_alpha=2 * rank,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            seed=rank,
        )
        tensors = safetensors.torch.load_file(folder / "adapter_model.safetensors")
        templates.append(((folder / "adapter_config.json").read_text(), tensors))
    generator = torch.Generator().manual_seed(args.seed)
    dirs = []
    for i in range(count):
        config, tensors = templates[i % 2]
        folder = root / "adapters" / f"a{i:04d}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(config)
        fresh = {
            k: (torch.randn(v.shape, generator=generator) * 0.02).to(v.dtype) for k, v in tensors.items()
        }
        safetensors.torch.save_file(fresh, folder / "adapter_model.safetensors")
        dirs.append(folder)
    return base, dirs


#: The environment each ``+FLAG`` of a plugin server's kind adds (``vllm+lora_pin`` adds none).
PLUGIN_FLAGS = {
    "compile": {"LORA_PIN_VLLM_COMPILE": "1"},
    "eager": {"LORA_PIN_VLLM_COMPILE": "0"},
    "rotate": {"LORA_PIN_VLLM_ROTATE": "1"},
}


def plugin_env(server: str) -> dict[str, str]:
    """The environment of a ``vllm+lora_pin[+FLAG...][@N]`` server: its flags' (:data:`PLUGIN_FLAGS`)
    and ``@N``'s age bound. Raises ``SystemExit`` naming a flag it does not know."""
    kind, _, age_bound = server.partition("@")
    env = {"LORA_PIN_VLLM_AGE_BOUND": age_bound} if age_bound else {}
    for flag in kind.split("+")[2:]:
        if flag not in PLUGIN_FLAGS:
            raise SystemExit(f"server {server!r}: unknown flag {flag!r} (known: {', '.join(PLUGIN_FLAGS)})")
        env.update(PLUGIN_FLAGS[flag])
    return env


class _VllmServer:
    """``vllm serve`` (or ``lora-pin vllm-serve``) from the vLLM venv, started and ready."""

    def __init__(
        self,
        plugin: bool,
        flags: list[str],
        args: argparse.Namespace,
        log: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_CPU_OMP_THREADS_BIND=args.threads_bind,
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
        )
        if plugin:
            launcher = [str(VLLM_PYTHON.parent / "lora-pin"), "vllm-serve"]
        else:
            env["VLLM_PLUGINS"] = ""
            launcher = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.cli.main", "serve"]
        env.update(extra_env or {})
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [*launcher, *flags, "--port", str(self.port), "--host", "127.0.0.1"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.started = time.perf_counter()
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    self.startup = time.perf_counter() - self.started
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError("vllm serve did not start")

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=120)
        self._log.close()


async def _closed_loop(url: str, workload: list[Any], concurrency: int, pinned: set[str]) -> dict[str, float]:
    """Serves ``workload`` (serve_load's tuples; arrival times ignored) with ``concurrency`` requests in
    flight: output tok/s, TTFT p50/p99 (s), TPOT p50/p99 (s: a request's time between its first and last
    token over the tokens after its first), and the TTFT of the requests of the ``pinned`` adapters."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    pinned_ttft: list[float] = []
    tpot: list[float] = []
    tokens = 0

    async def one(name: str | None, prompt: list[int], n: int) -> None:
        nonlocal tokens
        async with gate:
            sent = time.perf_counter()
            stamps = await serve_load._stream(client, name, prompt, n)
            tokens += len(stamps)
            first = (stamps[0] if stamps else time.perf_counter()) - sent
            ttft.append(first)
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
            if name in pinned:
                pinned_ttft.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(one(name, prompt, n) for _, name, prompt, n in workload))
    wall = time.perf_counter() - start
    await client.close()
    pct = serve_load._pct
    return {
        "tok/s": tokens / wall,
        "ttft p50": pct(ttft, 50),
        "ttft p99": pct(ttft, 99),
        "tpot p50": pct(tpot, 50),
        "tpot p99": pct(tpot, 99),
        "pinned ttft p50": pct(pinned_ttft, 50),
        "pinned ttft p99": pct(pinned_ttft, 99),
        "pinned requests": len(pinned_ttft),
    }


def _workload(args: argparse.Namespace, count: int, names: list[str]) -> list[Any]:
    """serve_load's workload over the first ``count`` adapters; ``count`` 0: the same prompts and lengths
    (they do not depend on the adapters) all on the base model."""
    if count:
        return serve_load._workload(args, count, names)
    return [(at, None, prompt, n) for at, _, prompt, n in serve_load._workload(args, 1, names)]


def _serve_all(url: str, args: argparse.Namespace, counts: list[int], names: list[str], lora: bool) -> dict:
    """A warm-up, then LoRA off (``lora`` False) or each adapter count: configuration -> result."""
    results = {}
    pinned = set(names[: args.pinned])
    asyncio.run(_closed_loop(url, _workload(args, counts[0] if lora else 0, names)[:8], 8, pinned))
    for count in counts if lora else [0]:
        label = f"{count} adapters" if count else "LoRA off"
        workload = _workload(args, count, names)
        results[label] = asyncio.run(_closed_loop(url, workload, args.concurrency, pinned))
    return results


def main() -> int:
    args = _args()
    counts = [int(c) for c in args.adapter_counts.split(",")]
    servers = args.servers.split(",")
    root = Path(tempfile.mkdtemp(prefix="vllm_load-"))
    t0 = time.perf_counter()
    base, dirs = _make_model(root, args, max(counts))
    names = [d.name for d in dirs]
    print(
        f"# hidden {args.hidden}, {args.layers} layers, {args.dtype}; "
        f"{len(dirs)} adapters rank 8/16 on q/k/v/o",
        flush=True,
    )
    model = [str(base), "--served-model-name", "base", "--dtype", args.dtype, "--max-model-len", "256"]
    lora = [
        "--enable-lora",
        "--max-loras",
        str(args.slots),
        "--max-cpu-loras",
        str(args.host),
        "--max-lora-rank",
        "16",
        *target_modules(args),
        "--lora-modules",
    ]
    # vLLM's parser refuses "pinned": only lora-pin vllm-serve (the plugin) takes it out and pins.
    modules = [{"name": n, "path": str(d)} for n, d in zip(names, dirs, strict=True)]
    plain = [json.dumps(m) for m in modules]
    with_pins = [json.dumps({**m, "pinned": True} if i < args.pinned else m) for i, m in enumerate(modules)]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for round_, server in itertools.product(range(args.rounds), servers):
        key = f"{server} #{round_ + 1}" if args.rounds > 1 else server
        results[key] = {}
        for with_lora in (False, True):
            label = f"{key} {'lora' if with_lora else 'base'}"
            log = root / f"{label.replace(' ', '-')}.log"
            if server == "lora-pin":
                engine = [
                    "--model",
                    str(base),
                    "--served-model-name",
                    "base",
                    "--device",
                    "cpu",
                    "--dtype",
                    args.dtype,
                ]
                # As serve_load does: half the host tier at start-up (the pins among them), the rest
                # loaded over HTTP.
                startup = [
                    json.dumps({"lora_name": n, "lora_path": str(d), "pinned": i < args.pinned})
                    for i, (n, d) in enumerate(zip(names, dirs, strict=True))
                ]
                lp_lora = [
                    "--lora-paths",
                    *startup[: args.host // 2],
                    "--max-loras-per-batch",
                    str(args.slots),
                    "--max-loaded-loras",
                    str(args.host),
                    "--max-lora-rank",
                    "16",
                    *target_modules(args, default=["q_proj", "k_proj", "v_proj", "o_proj"]),
                    "--allow-runtime-lora-updating",
                    "--lora-root",
                    str(root / "adapters"),
                ]
                proc = serve_load._Server(engine + (lp_lora if with_lora else []), args.threads, log)
                if with_lora:
                    for n, d in list(zip(names, dirs, strict=True))[args.host // 2 :]:
                        proc.post("/load_lora_adapter", {"lora_name": n, "lora_path": str(d)})
                url, stop = proc.url, proc.stop
            else:
                mods = plain if server == "vllm" else with_pins
                flags = model + (lora + mods if with_lora else [])
                plugin = server != "vllm"
                vproc = _VllmServer(plugin, flags, args, log, plugin_env(server) if plugin else {})
                url, stop = vproc.url, vproc.stop
                print(f"# {label}: started in {vproc.startup:.0f} s", flush=True)
            try:
                results[key].update(_serve_all(url, args, counts, names, with_lora))
            finally:
                stop()
            print(f"# {label}: {json.dumps(results[key])} load {os.getloadavg()[0]:.1f}", flush=True)
    print(
        "| server | configuration | tok/s | TTFT p50 s | TTFT p99 s | TPOT p50 / p99 ms "
        f"| tok/s vs its LoRA off | {args.pinned} top adapters' TTFT p50 / p99 s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for server, rows in results.items():
        off = rows["LoRA off"]["tok/s"]
        for label, r in rows.items():
            top = f"{r['pinned ttft p50']:.3f} / {r['pinned ttft p99']:.3f}" if label != "LoRA off" else ""
            print(
                f"| {server} | {label} | {r['tok/s']:.1f} | {r['ttft p50']:.3f} | {r['ttft p99']:.3f} | "
                f"{1000 * r['tpot p50']:.0f} / {1000 * r['tpot p99']:.0f} | {r['tok/s'] / off:.2f} | {top} |"
            )
    lo, hi = f"{min(counts)} adapters", f"{max(counts)} adapters"
    for server, rows in results.items():
        alone = server.split(" #")[0] == "vllm"
        if lo in rows and hi in rows and lo != hi:
            print(
                f"# {server}: the {args.pinned} top adapters' TTFT p99 at {hi} / at {lo}: "
                f"{rows[hi]['pinned ttft p99'] / rows[lo]['pinned ttft p99']:.2f}"
                + (" (not pinned: vLLM alone has no start-up pins)" if alone else "")
            )
    print(
        f"# {args.requests} requests per configuration, {args.concurrency} in flight, {args.popularity}, "
        f"prompt {args.prompt}, output {args.output}; {args.slots} slots, host {args.host}, "
        f"LoRA on {args.target_modules}; "
        f"{args.pinned} top adapters pinned (vllm+lora_pin, lora-pin); load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; total {time.perf_counter() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
