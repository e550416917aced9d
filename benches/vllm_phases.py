"""Where a step of ``vllm serve`` spends its time, with and without LoRA and lora_pin's plugin (issue 35).

Per-phase timers are put around vLLM's own methods in each of its processes (the engine core's
scheduler, the worker's model runner, LoRA manager, LoRA layers and punica wrapper) through a
``sitecustomize`` on ``PYTHONPATH``; each process writes its totals to a file twice a second, and the
difference over the measured run (after a warm-up) is printed per configuration: calls, wall and CPU
seconds (``process_time``: all the process's threads, steadier than wall on a shared machine) and the
calling thread's CPU seconds (``thread_time``; the rest of the CPU column is other threads' meanwhile:
torch's OpenMP workers spinning after a parallel region, lora_pin's kernel threads), per step, beside
the requests and tokens a step ran.

Configurations are ``MODE:ADAPTERS`` (``plugin``: ``lora-pin vllm-serve`` with ``LORA_PIN_VLLM_COMPILE=0``,
the model eager with LoRA on; ``compiled``: the same with ``LORA_PIN_VLLM_COMPILE=1``, vLLM's compiled
forward kept with LoRA on, the plugin's default since December 2026; ``vllm``: vLLM alone; 0
adapters: LoRA off), run in turn on ``benches/vllm_load.py``'s model and workload, for example
``.venv/bin/python benches/vllm_phases.py plugin:64,plugin:0,vllm:64 --hidden 1024 --layers 8
--requests 128``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import glob
import importlib.abc
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# What is timed: module -> (class, method, label) for each method.
TIMED = {
    "vllm.v1.core.sched.scheduler": [("Scheduler", "schedule", "scheduler (vLLM's step)")],
    "lora_pin.vllm.scheduler": [("Scheduler", "_hold_back", "scheduler: lora_pin's admission")],
    "vllm.v1.worker.gpu_model_runner": [
        ("GPUModelRunner", "_prepare_inputs", "prepare inputs"),
        ("GPUModelRunner", "_model_forward", "model forward"),
        ("GPUModelRunner", "sample_tokens", "sample"),
    ],
    "vllm.v1.worker.lora_model_runner_mixin": [
        ("LoRAModelRunnerMixin", "_set_active_loras", "LoRA: activation")
    ],
    "vllm.lora.worker_manager": [("WorkerLoRAManager", "_load_adapter", "LoRA: adapter read from disk")],
    "vllm.lora.model_manager": [
        ("LoRAModelManager", "_set_adapter_mapping", "LoRA: mapping (update_metadata)")
    ],
    "vllm.lora.layers.base_linear": [
        ("BaseLinearLayerWithLoRA", "_apply_lora_to_output", "LoRA: linear layers' math"),
        ("BaseLinearLayerWithLoRA", "reset_lora", "LoRA: zeroing a slot (reset_lora)"),
        ("BaseLinearLayerWithLoRA", "set_lora", "LoRA: copying into a slot (set_lora)"),
    ],
    "lora_pin.ops.backends.cpu": [("CpuDelta", "apply", "LoRA: lora_pin's kernels (CpuDelta.apply)")],
    "lora_pin.vllm.punica": [
        ("LoraPinPunicaWrapper", "_lora_linear", "LoRA: lora_pin's layer work (linear)"),
        ("LoraPinPunicaWrapper", "_lora_embedding", "LoRA: lora_pin's layer work (embedding)"),
    ],
}

# Methods traced into vLLM's compiled forward (a timer there would be traced too): not timed when compiled.
TRACED = {"LoRA: linear layers' math"}

# label -> [calls, wall s, CPU s (all threads), CPU s (the calling thread)]
_stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])


def _dump_forever() -> None:
    """Writes this process's totals every half second (vLLM's processes are killed, not stopped)."""
    path = Path(os.environ["LORA_PIN_PHASES"]) / f"{os.getpid()}.json"
    while True:
        time.sleep(0.5)
        if _stats:
            path.write_text(json.dumps(_stats))


def _timed(label: str, method: Any) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            row = _stats[label]
            row[0] += 1
            row[1] += time.perf_counter() - wall
            row[2] += time.process_time() - cpu
            row[3] += time.thread_time() - own

    return wrapper


def _execute_model(method: Any) -> Any:
    """The model runner's step, counting its requests and tokens."""
    timed = _timed("step (execute_model)", method)

    @functools.wraps(method)
    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        tokens = scheduler_output.total_num_scheduled_tokens
        for label, value in (("#steps", 1 if tokens else 0), ("#tokens", tokens)):
            _stats[label][0] += value
        _stats["#requests"][0] += len(scheduler_output.num_scheduled_tokens)
        return timed(self, scheduler_output, *args, **kwargs)

    return wrapper


def _patch(name: str, module: Any) -> None:
    compiled = os.environ.get("LORA_PIN_VLLM_COMPILE") == "1"
    for owner, method, label in TIMED.get(name, []):
        if compiled and label in TRACED:
            continue
        cls = getattr(module, owner)
        setattr(cls, method, _timed(label, getattr(cls, method)))
    if name == "vllm.v1.worker.gpu_model_runner":
        module.GPUModelRunner.execute_model = _execute_model(module.GPUModelRunner.execute_model)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each module of :data:`TIMED` as it is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TIMED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(name, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Run by the ``sitecustomize`` :func:`main` writes, in each of vLLM's processes."""
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_dump_forever, daemon=True).start()


def _totals(folder: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for path in glob.glob(str(folder / "*.json")):
        try:
            stats = json.loads(Path(path).read_text())
        except (OSError, ValueError):  # being rewritten: the next snapshot has it
            continue
        for label, row in stats.items():
            out[label] = [a + b for a, b in zip(out.get(label, [0, 0.0, 0.0, 0.0]), row, strict=True)]
    return out


def main() -> int:
    sys.path.insert(0, str(HERE))
    import vllm_load

    configs = sys.argv[1].split(",")
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    args = vllm_load._args()
    root = Path(tempfile.mkdtemp(prefix="vllm_phases-"))
    counts = [int(c.split(":")[1]) for c in configs]
    base, dirs = vllm_load._make_model(root, args, max(max(counts), 1))
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport vllm_phases\nvllm_phases.install()\n"
    )
    os.environ["PYTHONPATH"] = str(site)
    print(
        f"# hidden {args.hidden}, {args.layers} layers; {args.requests} requests, "
        f"{args.concurrency} in flight"
    )
    for i, config in enumerate(configs):
        mode, count = config.split(":")
        folder = root / f"stats-{i}"
        folder.mkdir()
        os.environ["LORA_PIN_PHASES"] = str(folder)
        # Said in both plugin modes: the plugin's default is compiled.
        compiled = {"LORA_PIN_VLLM_COMPILE": "1" if mode == "compiled" else "0"} if mode != "vllm" else {}
        names = [d.name for d in dirs[: int(count)]]
        model = [str(base), "--served-model-name", "base", "--dtype", args.dtype, "--max-model-len", "256"]
        lora = [
            *("--enable-lora", "--max-loras", str(args.slots), "--max-cpu-loras", str(args.host)),
            *("--max-lora-rank", "16", *vllm_load.target_modules(args), "--lora-modules"),
            *(json.dumps({"name": n, "path": str(d)}) for n, d in zip(names, dirs, strict=False)),
        ]
        server = vllm_load._VllmServer(
            mode in ("plugin", "compiled"), model + (lora if names else []), args, root / f"{i}.log", compiled
        )
        try:
            workload = vllm_load._workload(args, len(names), [d.name for d in dirs])
            asyncio.run(vllm_load._closed_loop(server.url, workload[:8], 8, set()))
            time.sleep(1.5)  # two dumps: every process's totals are on disk
            before = _totals(folder)
            result = asyncio.run(vllm_load._closed_loop(server.url, workload, args.concurrency, set()))
            time.sleep(1.5)
            after = _totals(folder)
        finally:
            server.stop()
        diff = {
            k: [a - b for a, b in zip(v, before.get(k, [0, 0.0, 0.0, 0.0]), strict=True)]
            for k, v in after.items()
        }
        steps = max(1, int(diff.get("#steps", [1])[0]))
        print(
            f"\n## {config}: {result['tok/s']:.1f} tok/s, TTFT p50 {result['ttft p50']:.2f} s; load "
            f"{os.getloadavg()[0]:.1f}; per step: {diff['#requests'][0] / steps:.1f} requests, "
            f"{diff['#tokens'][0] / steps:.1f} tokens"
        )
        print("| phase | calls | wall ms / step | CPU ms / step | of it the calling thread's |")
        print("| --- | --- | --- | --- | --- |")
        for label, (calls, wall, cpu, own) in sorted(diff.items(), key=lambda kv: -kv[1][1]):
            if calls and not label.startswith("#"):
                per_step = (f"{1000 * t / steps:.2f}" for t in (wall, cpu, own))
                print(f"| {label} | {calls:.0f} | {' | '.join(per_step)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
