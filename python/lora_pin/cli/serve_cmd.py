"""``lora-pin serve``: many adapters over HTTP on transformers' continuous-batching engine."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from lora_pin.args import add_lora_args, lora_config_from_args
from lora_pin.cli._model_dir import local_model_dir
from lora_pin.errors import SpecError
from lora_pin.serve import DEFAULT_MAX_QUEUED_REQUESTS

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_parser(subparsers: Any) -> None:
    """Registers ``serve`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model and its LoRA adapters over HTTP (OpenAI-compatible; vLLM/SGLang endpoints)",
        description=(
            "Loads --model and the --lora-paths adapters (pinned ones pinned) before the port opens, then "
            "serves /v1/completions, /v1/chat/completions, /v1/models, the adapter endpoints, /health and "
            "/metrics on transformers' continuous-batching engine. Needs the serve extra."
        ),
    )
    p.add_argument(
        "--model", type=Path, required=True, metavar="DIR", help="a local Hugging Face model folder"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the base model's name in requests (default: --model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LORA_PIN_API_KEY"),
        help="every request must bear 'Authorization: Bearer KEY' (default: $LORA_PIN_API_KEY, else none)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable the load/unload/pin/unpin endpoints (needs --lora-root)",
    )
    p.add_argument(
        "--lora-root",
        action="append",
        default=None,
        metavar="DIR",
        help="adapters (start-up ones too) must lie under one of these folders; repeatable",
    )
    p.add_argument(
        "--lora-loading",
        default="background",
        choices=("background", "blocking"),
        help="how adapters missing from host memory are read (default %(default)s)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens one step takes (engine default)",
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, metavar="N", help="KV-cache pages (engine default)"
    )
    p.add_argument("--page-size", type=int, default=None, metavar="N", help="tokens per KV-cache page")
    p.add_argument(
        "--max-memory-percent",
        type=float,
        default=None,
        metavar="F",
        help="share of free device memory the KV cache may take, 0..1 (engine default)",
    )
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="the model's dtype (default %(default)s)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="longest prompt plus output (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="a chat request's output limit when it sets none (default %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        metavar="N",
        help="largest request body (default 4 MiB)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        metavar="N",
        help="requests that may wait for the engine to start them; past it a new one gets 503 with "
        "Retry-After (default %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log level of the server and the adapter events (default %(default)s)",
    )
    replicas = p.add_argument_group("replicas on Ray Serve (the ray extra)")
    replicas.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="N",
        help="serve N replicas, each with its own engine and adapters, on a local Ray cluster behind one "
        "ingress that routes by adapter placement (default: one server, no Ray)",
    )
    replicas.add_argument(
        "--replica-cpus",
        type=float,
        default=0.5,
        metavar="F",
        help="Ray's logical CPUs per replica (default %(default)s)",
    )
    replicas.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        metavar="F",
        help="GPUs per replica; Ray gives each replica its own devices (default %(default)s: CPU)",
    )
    replicas.add_argument(
        "--replica-queue-bound",
        type=int,
        default=8,
        metavar="N",
        help="a replica's queued and running requests at which its adapters' requests spill to the "
        "next replica (default %(default)s)",
    )
    replicas.add_argument(
        "--replica-health-check-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a replica may leave Ray Serve's health check unanswered before it is replaced "
        "(default %(default)s)",
    )
    add_lora_args(p)
    p.set_defaults(run=run)


def build_server(args: argparse.Namespace) -> Any:
    """The :class:`~lora_pin.serve.app.ServerState` for ``args``: model, manager (its start-up adapters
    loaded and pinned) and engine built and started.

    Raises:
        SpecError: bad arguments; AdapterLoadError: a start-up adapter cannot be served.
    """
    import torch
    import transformers

    from lora_pin.model import LoRAManager
    from lora_pin.serve.adapters import AdapterAdmin
    from lora_pin.serve.app import ServerState
    from lora_pin.serve.engine import EngineConfig, LoRAEngine
    from lora_pin.serve.metrics import ServeMetrics

    model_dir = local_model_dir(args.model)
    if args.max_queued_requests < 1:
        raise SpecError(f"--max-queued-requests must be at least 1 (got {args.max_queued_requests})")
    if args.allow_runtime_lora_updating and not args.lora_root:
        raise SpecError(
            "--allow-runtime-lora-updating needs --lora-root: the folders adapters may be loaded from"
        )
    config = lora_config_from_args(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        # transformers types PreTrainedModel.to through a decorator that mypy reads as taking a model.
        model = model.to(device).eval()  # type: ignore[arg-type]
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise SpecError(f"--model: cannot load a causal LM and its tokenizer from {model_dir!r}: {e}") from e
    manager = None
    if config is not None:
        manager = LoRAManager.from_config(
            model, config, allowed_roots=args.lora_root, loading=args.lora_loading
        )
    startup = () if config is None else config.refs
    log = logging.getLogger("lora_pin.serve")
    for ref in startup:
        log.info(
            "adapter %r: loaded from %s at start-up%s",
            ref.lora_name,
            ref.lora_path,
            ", pinned" if ref.pinned else "",
        )
    engine_config = EngineConfig(
        max_batch_tokens=args.max_batch_tokens,
        num_blocks=args.num_blocks,
        page_size=args.page_size,
        max_memory_percent=args.max_memory_percent,
    )
    engine = LoRAEngine(model, manager, engine_config, eos_token_id=tokenizer.eos_token_id)
    admin = AdapterAdmin(manager, startup)
    max_len = args.max_model_len or getattr(model.config, "max_position_embeddings", None) or 2048
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        admin=admin,
        metrics=ServeMetrics(manager, admin.outstanding, engine_stats=engine.stats),
        base_name=args.served_model_name or str(args.model),
        max_model_len=max_len,
        api_key=args.api_key,
        allow_runtime_updates=args.allow_runtime_lora_updating,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        max_queued_requests=args.max_queued_requests,
    )
    engine.start()
    return state


def run(args: argparse.Namespace) -> int:
    """Serves until interrupted; 0 after a clean shutdown.

    Raises:
        SpecError: bad arguments; AdapterLoadError: a start-up adapter cannot be served.
    """
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import transformers

    transformers.logging.set_verbosity_error()
    if args.replicas < 0:
        raise SpecError(f"--replicas must be 0 (one server) or more (got {args.replicas})")
    if args.replicas > 0:
        from lora_pin.serve.ray import run_local

        return run_local(args, build_server, replicas=args.replicas)
    import uvicorn

    from lora_pin.serve.app import build_app

    state = build_server(args)
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        state.engine.stop()
    return 0


def ray_app(options: dict[str, str]) -> Any:
    """The replicated server as a Ray Serve application builder, for an existing cluster:
    ``serve run lora_pin.cli.serve_cmd:ray_app flags="--model DIR --replicas 2 ..."`` (or the same
    ``import_path`` and ``args`` in a Serve config file). ``flags`` holds ``lora-pin serve``'s flags;
    ``--host``/``--port`` are Ray Serve's own settings there.

    Raises:
        SpecError: ``flags`` is missing or not valid ``lora-pin serve`` flags.
    """
    import shlex

    from lora_pin.serve.ray import build_application

    parser = argparse.ArgumentParser(prog="lora-pin", exit_on_error=False)
    add_parser(parser.add_subparsers())
    flags = options.get("flags")
    if not isinstance(flags, str) or not flags.strip():
        raise SpecError('ray_app needs flags="--model DIR ..." (lora-pin serve\'s flags)')
    try:
        args = parser.parse_args(["serve", *shlex.split(flags)])
    except (argparse.ArgumentError, SystemExit) as e:
        raise SpecError(f"ray_app: flags {flags!r} are not lora-pin serve's flags: {e}") from e
    return build_application(
        args,
        build_server,
        replicas=max(1, args.replicas),
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        queue_bound=args.replica_queue_bound,
        health_check_timeout_s=args.replica_health_check_timeout,
    )
