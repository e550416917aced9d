"""``lora-pin serve``: many adapters over HTTP on transformers' continuous-batching engine."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from lora_pin.args import DEFAULT_MAX_LORAS_PER_BATCH, add_lora_args, lora_config_from_args
from lora_pin.cli._model_dir import local_model_dir
from lora_pin.errors import SpecError
from lora_pin.serve import DEFAULT_MAX_QUEUED_REQUESTS

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache on CPU when --kv-cache-memory is not given (vLLM's VLLM_CPU_KVCACHE_SPACE plays this part).
DEFAULT_CPU_KV_CACHE_GIB = 1.0
# The engine's page size when --page-size is not given (transformers' default).
_ENGINE_PAGE_SIZE = 256


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
        help="requests to the API must bear 'Authorization: Bearer KEY' (default: $LORA_PIN_API_KEY, else "
        "none); /health, /metrics and /version stay open unless --api-key-all-endpoints",
    )
    p.add_argument(
        "--api-key-all-endpoints",
        action="store_true",
        help="--api-key guards /health, /metrics and /version too",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="a local tokenizer folder (default: --model's)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template for /v1/chat/completions: a file, or the Jinja template itself "
        "(default: the tokenizer's)",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="never share KV-cache blocks between requests (default: shared among requests with the same "
        "prompt prefix and the same adapter weights)",
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
        "--admission-order",
        default="arrival",
        choices=("arrival", "longest-remaining"),
        help=(
            "the order requests are offered to a step's adapter admission: arrival (started ones keep "
            "running), or longest-remaining (most tokens left first, running or waiting: fewer steps "
            "for a batch when adapter memory is short, a nearly done request may sit out steps); "
            "default %(default)s"
        ),
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, metavar="N", help="KV-cache pages (engine default)"
    )
    p.add_argument("--page-size", type=int, default=None, metavar="N", help="tokens per KV-cache page")
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help=f"the KV cache's size in GiB (default: {DEFAULT_CPU_KV_CACHE_GIB:g} GiB on CPU; on CUDA the "
        "engine's share of free memory, --max-memory-percent); --num-blocks, when given, wins",
    )
    p.add_argument(
        "--max-memory-percent",
        type=float,
        default=None,
        metavar="F",
        help="share of free device memory the KV cache may take on CUDA, 0..1 (engine default)",
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
        default=None,
        metavar="N",
        help="a request's output limit when it sets none, at most the room left in the context "
        "(default: the room left)",
    )
    p.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between the periodic status log lines; 0 turns them off (default %(default)s)",
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
    paging = p.add_argument_group("adapter memory in rank pages (issue 37)")
    paging.add_argument(
        "--page-rank",
        type=int,
        default=None,
        metavar="N",
        help="hold adapters in device pages of N ranks (with --max-lora-memory; 8 is S-LoRA's and "
        "SGLang's choice): an adapter of rank r takes ceil(r / N) pages instead of a --max-lora-rank slot, "
        "so a step holds as many adapters as their pages fit; --max-loras-per-batch then bounds the "
        "adapters of a step only when given",
    )
    paging.add_argument(
        "--max-lora-memory",
        default=None,
        metavar="BYTES",
        help="the paged adapter pool's device memory (with --page-rank): bytes, or a number with a unit "
        "(512MiB, 2GiB, 1.5GB); it must hold one adapter of --max-lora-rank",
    )
    add_lora_args(p)
    # Paged, the adapters per step are bounded by the pages unless this is given (slots: 8 as before).
    p.set_defaults(max_loras_per_batch=None)
    for action in p._actions:
        if action.dest == "max_loras_per_batch":
            action.help = (
                f"Device slots: distinct adapters one step can use (default {DEFAULT_MAX_LORAS_PER_BATCH}; "
                "with --page-rank, no bound but the pages)."
            )
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
    from lora_pin.serve.adapters import AdapterAdmin, check_adapter_name
    from lora_pin.serve.app import ServerState
    from lora_pin.serve.engine import EngineConfig, LoRAEngine
    from lora_pin.serve.metrics import ServeMetrics, StatusLog

    model_dir = local_model_dir(args.model)
    if args.max_queued_requests < 1:
        raise SpecError(f"--max-queued-requests must be at least 1 (got {args.max_queued_requests})")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise SpecError(f"--default-max-tokens must be at least 1 (got {args.default_max_tokens})")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        raise SpecError(f"--kv-cache-memory must be above 0 GiB (got {args.kv_cache_memory})")
    if args.log_interval < 0:
        raise SpecError(f"--log-interval must be 0 (off) or more seconds (got {args.log_interval})")
    base_name = args.served_model_name or str(args.model)
    if args.allow_runtime_lora_updating and not args.lora_root:
        raise SpecError(
            "--allow-runtime-lora-updating needs --lora-root: the folders adapters may be loaded from"
        )
    # Start-up adapters past the host tier are registered too (as vLLM's --lora-modules past
    # --max-cpu-loras): the tier's first ones at start, the rest loaded after (idle adapters leave the
    # host tier for them, read again on first use).
    paged = args.page_rank is not None or args.max_lora_memory is not None
    if paged and (args.page_rank is None or args.max_lora_memory is None):
        raise SpecError(
            f"--page-rank and --max-lora-memory go together (got --page-rank={args.page_rank}, "
            f"--max-lora-memory={args.max_lora_memory})"
        )
    slots = args.max_loras_per_batch
    config = lora_config_from_args(
        argparse.Namespace(
            **{
                **vars(args),
                "max_loaded_loras": None,
                "max_loras_per_batch": DEFAULT_MAX_LORAS_PER_BATCH if slots is None else slots,
            }
        )
    )
    later: list[Any] = []
    if config is not None and args.max_loaded_loras is not None:
        first, later = _split_startup(config.refs, args.max_loaded_loras)
        config = dataclasses.replace(config, refs=first, max_loaded_loras=args.max_loaded_loras)
    for ref in () if config is None else (*config.refs, *later):
        check_adapter_name(ref.lora_name, base_name)
    chat_template = _chat_template(args.chat_template)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        # transformers types PreTrainedModel.to through a decorator that mypy reads as taking a model.
        model = model.to(device).eval()  # type: ignore[arg-type]
    except (OSError, ValueError) as e:
        raise SpecError(f"--model: cannot load a causal LM from {model_dir!r}: {e}") from e
    tokenizer_dir = model_dir if args.tokenizer is None else local_model_dir(args.tokenizer)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise SpecError(f"--tokenizer: cannot load a tokenizer from {tokenizer_dir!r}: {e}") from e
    manager = None
    if config is not None:
        paging: dict[str, Any] = {}
        if paged:
            paging = dict(
                page_rank=args.page_rank, max_lora_memory=args.max_lora_memory, max_loras_per_batch=slots
            )
        manager = LoRAManager.from_config(
            model, config, allowed_roots=args.lora_root, loading=args.lora_loading, **paging
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
    if manager is not None:
        for ref in later:
            later_ref = manager.load(ref.lora_name, ref.lora_path)
            startup = (*startup, later_ref)
            log.info("adapter %r: registered from %s at start-up", ref.lora_name, ref.lora_path)
    num_blocks = args.num_blocks
    kv_gib = args.kv_cache_memory
    if num_blocks is None and kv_gib is None and device.type == "cpu":
        kv_gib = DEFAULT_CPU_KV_CACHE_GIB
    if num_blocks is None and kv_gib is not None:
        num_blocks = kv_cache_blocks(model.config, model.dtype, args.page_size or _ENGINE_PAGE_SIZE, kv_gib)
    engine_config = EngineConfig(
        max_batch_tokens=args.max_batch_tokens,
        num_blocks=num_blocks,
        page_size=args.page_size,
        max_memory_percent=args.max_memory_percent,
    )
    engine = LoRAEngine(
        model,
        manager,
        engine_config,
        eos_token_id=tokenizer.eos_token_id,
        prefix_caching=args.prefix_caching,
        admission_order=args.admission_order.replace("-", "_"),
    )
    admin = AdapterAdmin(manager, startup, base_name=base_name)
    max_len = args.max_model_len or getattr(model.config, "max_position_embeddings", None) or 2048
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        admin=admin,
        metrics=ServeMetrics(
            manager, admin.outstanding, engine_stats=engine.stats, prefix_stats=engine.prefix_stats
        ),
        base_name=base_name,
        max_model_len=max_len,
        api_key=args.api_key,
        api_key_all_endpoints=args.api_key_all_endpoints,
        allow_runtime_updates=args.allow_runtime_lora_updating,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        max_queued_requests=args.max_queued_requests,
        chat_template=chat_template,
    )
    engine.start()
    if args.log_interval > 0:
        StatusLog(engine, manager, args.log_interval).start()
    return state


def _split_startup(refs: tuple[Any, ...], loaded: int) -> tuple[tuple[Any, ...], list[Any]]:
    """The start-up adapters the manager takes at once (the pinned ones, then the first others, up to
    ``loaded``) and those loaded after it, in the order given.

    Raises:
        SpecError: more pinned adapters than ``loaded`` (they must all stay in host memory).
    """
    pinned = sum(r.pinned for r in refs)
    if pinned > loaded:
        raise SpecError(
            f"{pinned} start-up adapters are pinned but --max-loaded-loras={loaded} holds at most {loaded}"
        )
    room = loaded - pinned
    first: list[Any] = []
    later: list[Any] = []
    for ref in refs:
        if ref.pinned or room > 0:
            room -= not ref.pinned
            first.append(ref)
        else:
            later.append(ref)
    return tuple(first), later


def kv_cache_blocks(config: Any, dtype: Any, page_size: int, gib: float) -> int:
    """KV-cache blocks (``page_size`` tokens of keys and values in every layer) that fit in ``gib`` GiB
    for a model of ``config`` in ``dtype``.

    Raises:
        SpecError: not even one block fits.
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_block = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize * page_size
    blocks = int(gib * 2**30) // per_block
    if blocks < 1:
        raise SpecError(f"--kv-cache-memory {gib:g} GiB holds no block of {per_block} bytes")
    return blocks


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or the template itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError as e:
        raise SpecError(f"--chat-template: cannot read {value!r}: {e}") from e
    if "{" not in value:
        raise SpecError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


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
