"""``lora-pin demo``: the main job. Serves a mixed workload over many adapters, two of them pinned, and
checks sampled steps against PEFT; exits 1 when outputs differ or a pinned adapter was evicted."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path
from typing import Any

import orjson

from lora_pin.args import EVICTION_POLICIES
from lora_pin.cli._model_dir import local_model_dir
from lora_pin.errors import SpecError


def add_parser(subparsers: Any) -> None:
    """Registers ``demo`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "demo",
        help="serve a mixed workload over many adapters (two pinned) and check it against PEFT",
        description=(
            "With no --model, generates a tiny Llama-style model and a dozen PEFT adapters into the cache "
            "folder on first run (no network), then replays a Zipf-popular workload of prefill and decode "
            "steps with base-model requests mixed in, and reports speed, cache behaviour, pinned residency "
            "and a correctness check of sampled steps against PEFT."
        ),
    )
    _add_model_args(p)
    _add_capacity_args(p)
    _add_workload_args(p)
    _add_parallel_args(p)
    _add_output_args(p)
    p.set_defaults(run=run)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """What is served: the generated assets, or a local model with its adapters."""
    p.add_argument(
        "--model", type=Path, default=None, metavar="DIR", help="a local Hugging Face model folder"
    )
    p.add_argument(
        "--lora-paths",
        nargs="*",
        default=None,
        metavar="ITEM",
        help="adapter items over --model, as a server takes them (PATH, NAME=PATH, JSON, @FILE)",
    )
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="modules to wrap, e.g. lm_head q_proj v_proj (default: all, every linear layer but the output "
        "layer, as PEFT's all-linear; name lm_head or embed_tokens to serve adapters on them)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the generated demo assets live (default ~/.cache/lora_pin)",
    )


def _add_capacity_args(p: argparse.ArgumentParser) -> None:
    """The two tiers' sizes and their eviction policy."""
    p.add_argument(
        "--max-loras-per-batch", type=int, default=4, metavar="N", help="device slots (default %(default)s)"
    )
    p.add_argument(
        "--max-loaded-loras",
        type=int,
        default=8,
        metavar="N",
        help="host-tier capacity in adapters (default %(default)s)",
    )
    p.add_argument(
        "--eviction-policy",
        default="lru",
        choices=EVICTION_POLICIES,
        help="eviction policy of both tiers (default %(default)s)",
    )


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The replayed requests, their steps and how often a step is checked against PEFT."""
    p.add_argument("--requests", type=int, default=400, help="requests to serve (default %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=8, help="sequences a step takes at most (default %(default)s)"
    )
    p.add_argument(
        "--prefill-len",
        type=int,
        default=32,
        help="tokens of a prefill step's sequences (default %(default)s)",
    )
    p.add_argument(
        "--zipf-alpha",
        type=float,
        default=1.1,
        help="skew of the adapters' popularity; 0 is uniform (default %(default)s)",
    )
    p.add_argument("--check-every", type=int, default=5, help="check every Nth step against PEFT (0: never)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the workload and the inputs (default %(default)s)"
    )


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism over gloo processes on this machine."""
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="serve the model cut over N tensor-parallel processes (gloo, CPU), each holding 1/N of every "
        "adapter (Llama-style models; default %(default)s: one process)",
    )
    p.add_argument(
        "--fully-sharded",
        action="store_true",
        help="with --tp, also cut the adapters' rank dimension (S-LoRA's scheme)",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """The report's form."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is shown only when stderr is a terminal anyway)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs the demo; 0 when every checked step matched PEFT and no pinned adapter was evicted, else 1.

    Raises:
        SpecError: bad arguments (``--lora-paths`` without ``--model``, no adapters).
        AdapterLoadError: an adapter cannot be served.
    """
    # Before any work: a missing hf extra is named now, not after minutes of setup.
    importlib.import_module("peft")

    from lora_pin.demo.assets import ensure_demo_assets

    _check_numbers(args)
    _quiet()
    if args.model is None:
        if args.lora_paths:
            raise SpecError("--lora-paths needs --model (the demo's own adapters fit only its own model)")
        assets = ensure_demo_assets(args.cache_dir)
        model_dir, items = assets.model_dir, assets.lora_paths
    else:
        model_dir, items = local_model_dir(args.model), args.lora_paths or []
        if not items:
            raise SpecError("--model needs --lora-paths naming at least one adapter")
    if args.tp > 1:
        return _run_tensor_parallel(args, model_dir, items)
    report, manager, adapters = _serve(args, model_dir, items, None)
    _print(args, report, manager, adapters)
    return 0 if report.ok else 1


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def _serve(args: argparse.Namespace, model_dir: Path, items: list[str], tp: Any) -> tuple[Any, Any, int]:
    """Build the model (cut over ``tp`` when given) and the manager, and replay the workload; returns the
    report, the manager and the number of adapters."""
    import torch
    import transformers

    from lora_pin._core import parse_lora_paths
    from lora_pin.demo.replay import replay
    from lora_pin.demo.workload import make_requests
    from lora_pin.model import LoRAManager

    refs = parse_lora_paths(items)
    # Pinned adapters first; what the host tier cannot hold at start-up is loaded at run time, as a
    # server would, and is then evicted from host memory and read again from disk as popularity moves.
    refs.sort(key=lambda r: not r.pinned)
    startup, later = refs[: args.max_loaded_loras], refs[args.max_loaded_loras :]
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise SpecError(f"--model: cannot load a causal LM from {str(model_dir)!r}: {e}") from e
    if tp is not None:
        from lora_pin.parallel_fixtures import shard_llama

        model = shard_llama(model, tp)
    manager = LoRAManager(
        model,
        startup,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        max_lora_rank=max(_rank(r.lora_path) for r in refs),
        lora_target_modules=args.lora_target_modules or ["all"],
        eviction_policy=args.eviction_policy,
        tp=tp,
    )
    for r in later:
        manager.load(r.lora_name, r.lora_path, pinned=r.pinned)
    oracle = _peft_oracle(model_dir, refs) if args.check_every else None
    requests = make_requests(
        [r.lora_name for r in refs], args.requests, zipf_alpha=args.zipf_alpha, seed=args.seed
    )
    report = replay(
        manager,
        requests,
        batch_size=args.batch_size,
        prefill_len=args.prefill_len,
        vocab_size=model.config.vocab_size,
        oracle=oracle,
        check_every=args.check_every,
        seed=args.seed,
        progress=not args.no_progress and (tp is None or tp.rank == 0),
    )
    return report, manager, len(refs)


def _print(args: argparse.Namespace, report: Any, manager: Any, adapters: int) -> None:
    if args.json:
        data = report.as_dict()
        if manager.tp is not None:
            data["tp"] = {"size": manager.tp.size, "fully_sharded": manager.tp.fully_sharded}
        sys.stdout.buffer.write(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        _print_report(report, manager, adapters)


def _run_tensor_parallel(args: argparse.Namespace, model_dir: Path, items: list[str]) -> int:
    """Start ``args.tp`` gloo processes on this machine, each serving its shard; rank 0 reports."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as scratch:
        status = Path(scratch) / "status"
        mp.spawn(
            _tensor_parallel_rank, args=(args, model_dir, items, port, status), nprocs=args.tp, join=True
        )
        return int(status.read_text())


def _tensor_parallel_rank(
    rank: int, args: argparse.Namespace, model_dir: Path, items: list[str], port: int, status: Path
) -> None:
    import os

    import torch
    import torch.distributed as dist

    from lora_pin.parallel import TensorParallel

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.tp)
    # The ranks share this machine's cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    _quiet()
    try:
        tp = TensorParallel(rank, args.tp, fully_sharded=args.fully_sharded)
        report, manager, adapters = _serve(args, model_dir, items, tp)
        if rank == 0:
            _print(args, report, manager, adapters)
            sys.stdout.flush()
            status.write_text("0" if report.ok else "1")
        # No rank tears the group down while another still talks over it: a rank that left first made
        # its peer's gloo threads abort now and then ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, least in (
        ("--requests", args.requests, 1),
        ("--batch-size", args.batch_size, 1),
        ("--prefill-len", args.prefill_len, 1),
        ("--check-every", args.check_every, 0),
        ("--seed", args.seed, 0),
        ("--tp", args.tp, 1),
    ):
        if value < least:
            raise SpecError(f"{flag} must be at least {least} (got {value})")
    if not 0 <= args.zipf_alpha < float("inf"):
        raise SpecError(f"--zipf-alpha must be a finite number >= 0 (got {args.zipf_alpha})")


def _rank(path: str) -> int:
    from lora_pin.weights import read_adapter_config

    config = read_adapter_config(path, Path(path))
    return max([config.r, *config.rank_pattern.values()])


def _peft_oracle(model_dir: Path, refs: list[Any]) -> Any:
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    peft = PeftModel.from_pretrained(base, refs[0].lora_path, adapter_name=refs[0].lora_name)
    for r in refs[1:]:
        peft.load_adapter(r.lora_path, adapter_name=r.lora_name)
    return peft.eval()


def _print_report(report: Any, manager: Any, adapters: int) -> None:
    s = report.stats
    lines = [
        f"lora-pin demo: {adapters} adapters over {manager.pool.slots} device slots "
        f"(host tier {s['host']['capacity']}), {report.steps} steps, {report.tokens} tokens",
        f"  throughput      {report.tokens_per_second:,.0f} tokens/s; step time "
        f"p50 {report.percentile_ms(50):.2f} ms, p99 {report.percentile_ms(99):.2f} ms; "
        f"{report.deferred} requests deferred to a later step",
    ]
    for tier in ("device", "host"):
        t = s[tier]
        lines.append(
            f"  {tier:<6} tier     hits {t['hits']}, misses {t['misses']}, loads {t['loads']}, "
            f"evictions {t['evictions']}, refusals {t['refusals']}; "
            f"resident {len(t['resident'])}/{t['capacity']}"
        )
    lines.append(
        f"  disk reads      {s['adapter_reads']}, {s['background_loads']} of them in the background by the "
        f"loader (off the steps' path), {s['background_load_failures']} failed"
    )
    if manager.tp is not None:
        mode = ", fully sharded" if manager.tp.fully_sharded else ""
        calls = s.get("tp_collective_calls", {})
        lines.append(
            f"  tensor parallel {manager.tp.size} gloo processes{mode}; LoRA collectives on rank 0: "
            + (", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "none")
        )
    pinned = ", ".join(report.pinned) or "none"
    if report.pinned_evictions:
        lines.append(f"  pinned          {pinned}: EVICTED {report.pinned_evictions}")
    else:
        lines.append(f"  pinned          {pinned}: resident throughout, never evicted")
    if report.checked_steps:
        verdict = "match" if not report.failed_steps else f"DIFFER at steps {report.failed_steps}"
        lines.append(
            f"  vs PEFT         {report.checked_steps} sampled steps {verdict} "
            f"(max relative error {report.max_relative_error:.2e}; the adapters moved logits by up to "
            f"{report.adapter_effect:.2e} relative to the base model)"
        )
    lines.append("  result          OK" if report.ok else "  result          FAILED")
    print("\n".join(lines))
