"""Server-args integration: ``add_lora_args`` puts lora_pin's flags on a framework's own parser, and
``lora_config_from_args`` turns the parsed namespace into one validated, typed :class:`LoRAConfig`.

A serving framework adds our flags in one line::

    lora_pin.add_lora_args(parser)
    config = lora_pin.lora_config_from_args(parser.parse_args())
"""

from __future__ import annotations

import argparse
import re
import warnings
from dataclasses import dataclass
from typing import Any

from lora_pin._core import EVICTION_POLICIES, MAX_ADAPTER_RANK, MAX_SLOTS, LoRARef, parse_lora_paths
from lora_pin.errors import SpecError

__all__ = [
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "EVICTION_POLICIES",
    "LoRAConfig",
    "add_lora_args",
    "add_vllm_lora_args",
    "lora_config_from_args",
    "lora_config_from_vllm_args",
    "parse_bytes",
]

DEFAULT_MAX_LORAS_PER_BATCH = 8
#: vLLM's defaults for its LoRA flags.
VLLM_DEFAULT_MAX_LORAS = 1
VLLM_DEFAULT_MAX_LORA_RANK = 16
VLLM_LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")

_SPEC_HELP = (
    "Adapters to serve. Each item: PATH (the name is the path), NAME=PATH, "
    'a JSON object {"lora_name": str, "lora_path": str, "pinned": bool} or '
    '{"name": str, "path": str, "base_model_name": str|null}, or @FILE (a JSON array of such items).'
)


@dataclass(frozen=True)
class LoRAConfig:
    """The validated LoRA serving configuration.

    Attributes:
        refs: the start-up adapters, in the order given.
        max_loras_per_batch: device slots (distinct adapters one step can use).
        max_loaded_loras: host-tier capacity in adapters, or ``None`` for unbounded.
        max_lora_rank: the slot pool's rank, or ``None`` to take the largest start-up adapter's.
        target_modules: module names to wrap (``("all",)`` for every supported one), or ``None`` to take
            the union of the start-up adapters'.
        eviction_policy: the device tier's eviction policy.
        lora_dtype: the adapters' dtype: ``"auto"`` (the model's), or a dtype name the model must have
            (vLLM's ``--lora-dtype``; lora_pin computes adapters in the model's dtype).
    """

    refs: tuple[LoRARef, ...]
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    eviction_policy: str = "lru"
    lora_dtype: str = "auto"

    @property
    def pinned(self) -> tuple[LoRARef, ...]:
        """The start-up adapters that are pinned."""
        return tuple(r for r in self.refs if r.pinned)


def add_lora_args(
    parser: argparse.ArgumentParser, *, prefix: str = "", skip_existing: bool = True
) -> argparse.ArgumentParser:
    """Adds ``--enable-lora``, ``--lora-paths``, ``--max-loras-per-batch``, ``--max-loaded-loras``,
    ``--max-lora-rank``, ``--lora-target-modules`` and ``--lora-eviction-policy`` to ``parser`` (in their own
    group), SGLang's names and defaults; returns it.

    Args:
        parser: the framework's parser.
        prefix: put before each flag's name (``prefix="lp-"`` gives ``--lp-lora-paths``, read back with
            ``lora_config_from_args(ns, prefix="lp-")``), to keep them apart from a framework's own.
        skip_existing: a flag the parser already has is left as the parser defines it (SGLang's parser has
            ``--lora-paths`` and the rest): :func:`lora_config_from_args` reads the parsed value the same
            way, whatever action produced it. With False such a flag raises argparse's error.

    Raises:
        argparse.ArgumentError: ``skip_existing`` is False and the parser already has one of these flags.
    """
    group = parser.add_argument_group("LoRA adapters (lora_pin)")
    existing = set(parser._option_string_actions) if skip_existing else set()

    def add(flag: str, **kwargs: Any) -> None:
        option = f"--{prefix}{flag}"
        if option not in existing:
            group.add_argument(option, dest=_dest(prefix, flag), **kwargs)

    add(
        "enable-lora",
        action="store_true",
        default=None,
        help="Serve LoRA adapters. Implied by --lora-paths (and by --max-lora-rank or "
        "--lora-target-modules); with no LoRA flag at all LoRA is off.",
    )
    add("lora-paths", nargs="*", default=None, metavar="ITEM", help=_SPEC_HELP)
    add(
        "max-loras-per-batch",
        type=int,
        default=DEFAULT_MAX_LORAS_PER_BATCH,
        help="Device slots: distinct adapters one step can use (default %(default)s).",
    )
    add(
        "max-loaded-loras",
        type=int,
        default=None,
        help="Host-tier capacity in adapters (default: unbounded). Must be >= --max-loras-per-batch.",
    )
    add(
        "max-lora-rank",
        type=int,
        default=None,
        help="The slot pool's rank (default: the largest start-up adapter's).",
    )
    add(
        "lora-target-modules",
        nargs="*",
        default=None,
        metavar="MODULE",
        help="Modules to wrap, e.g. q_proj v_proj, or 'all' alone for every module of the model lora_pin "
        "supports (default: the start-up adapters').",
    )
    add(
        "lora-eviction-policy",
        default="lru",
        choices=EVICTION_POLICIES,
        help="Device-tier eviction policy (default %(default)s).",
    )
    return parser


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(what: str, value: int | str) -> int:
    """``value`` in bytes: an int, or a string of a number and an optional unit (``512MiB``, ``2GB``,
    ``1.5GiB``, ``4096``; B, KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB powers of 1024, any case).

    Raises:
        SpecError: not a positive number of bytes (``what`` names the argument).
    """
    if isinstance(value, bool):
        raise SpecError(f"{what} must be a number of bytes (got {value!r})")
    if isinstance(value, int):
        count = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", value)
        unit = _BYTE_UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise SpecError(
                f"{what} must be bytes: a number with an optional unit, such as 512MiB or 2GB (got {value!r})"
            )
        count = int(float(match.group(1)) * unit)
    else:
        raise SpecError(f"{what} must be a number of bytes (got {value!r})")
    if count < 1:
        raise SpecError(f"{what} must be at least 1 byte (got {value!r})")
    return count


def _dest(prefix: str, flag: str) -> str:
    return f"{prefix}{flag}".replace("-", "_")


def lora_config_from_args(ns: argparse.Namespace, *, prefix: str = "") -> LoRAConfig | None:
    """Validates the namespace ``add_lora_args`` filled and returns the typed config, or None when LoRA is
    off.

    LoRA is on with ``--enable-lora``, with ``--lora-paths`` (as SGLang turns it on), or with
    ``--max-lora-rank`` or ``--lora-target-modules``; with none of them (no LoRA flag at all) it is off, as in
    SGLang. ``--lora-paths`` items may also be objects with ``lora_name``, ``lora_path`` and ``pinned``
    attributes (what a framework's own ``--lora-paths`` action may have made of them). A framework's own
    ``store_true`` ``--enable-lora`` reads False when not given, so ``enable_lora`` False with
    ``--lora-paths`` warns (``UserWarning``) and serves them, as SGLang does with ``--lora-paths`` alone.

    Raises:
        SpecError: an adapter item is invalid, the limits disagree (the message gives the numbers), a limit
            or the rank is out of range (the rank: ``1..MAX_ADAPTER_RANK``, the manager's limit), the target
            modules are not a list of non-empty names (a wrong entry is named by its position and type),
            ``all`` is not alone among them, the eviction policy is unknown, or there are no start-up
            adapters and the rank or target modules are missing.
    """

    def get(flag: str, default: Any = None) -> Any:
        return getattr(ns, _dest(prefix, flag), default)

    enable = get("enable-lora")
    items = get("lora-paths")
    rank = get("max-lora-rank")
    targets = get("lora-target-modules")
    if enable is False and items:
        warnings.warn(
            "--lora-paths was given while enable_lora is False (a store_true --enable-lora that was not "
            "passed): serving the adapters, as SGLang does with --lora-paths alone",
            UserWarning,
            stacklevel=2,
        )
    if not (enable or items or rank is not None or targets is not None):
        return None
    slots = get("max-loras-per-batch", DEFAULT_MAX_LORAS_PER_BATCH)
    loaded = get("max-loaded-loras")
    _check_count("--max-loras-per-batch", slots, MAX_SLOTS)
    if loaded is not None:
        _check_count("--max-loaded-loras", loaded, 2**63 - 1)
    refs = tuple(parse_lora_paths(_items(items), max_loras_per_batch=slots, max_loaded_loras=loaded))
    if rank is not None:
        _check_count("--max-lora-rank", rank, MAX_ADAPTER_RANK)
    targets = None if targets is None else _target_modules(targets)
    if not refs and (rank is None or targets is None):
        raise SpecError(
            "with no --lora-paths, both --max-lora-rank and --lora-target-modules are required to size the "
            f"slot pool (got --max-lora-rank={rank}, --lora-target-modules={targets})"
        )
    policy = get("lora-eviction-policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise SpecError(f"--lora-eviction-policy must be one of {EVICTION_POLICIES} (got {policy!r})")
    return LoRAConfig(
        refs=refs,
        max_loras_per_batch=slots,
        max_loaded_loras=loaded,
        max_lora_rank=rank,
        target_modules=targets,
        eviction_policy=policy,
    )


def _target_modules(targets: Any) -> tuple[str, ...]:
    """``--lora-target-modules`` as a tuple of names, each entry checked.

    Raises:
        SpecError: ``targets`` is not a list, tuple or set (a str included: it would split into letters),
            is empty, holds an entry that is not a str or is blank (named by position and type), or holds
            ``all`` beside other names.
    """
    if isinstance(targets, str) or not isinstance(targets, (list, tuple, set, frozenset)):
        got = f"the str {targets!r}" if isinstance(targets, str) else type(targets).__name__
        raise SpecError(f"--lora-target-modules must be a list of module names, got {got}")
    targets = tuple(targets)
    if not targets:
        raise SpecError("--lora-target-modules was given without any module")
    for i, t in enumerate(targets):
        if not isinstance(t, str):
            raise SpecError(f"--lora-target-modules[{i}] must be a module name (str), got {type(t).__name__}")
        if not t.strip():
            raise SpecError(f"--lora-target-modules[{i}] is an empty module name: {list(targets)!r}")
    if "all" in targets and len(targets) > 1:
        raise SpecError(f"--lora-target-modules: 'all' must stand alone (got {list(targets)!r})")
    return targets


def _check_count(flag: str, value: Any, most: int) -> None:
    """Checked here with the flag's name: past 2^64 the core could not even take the number."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{flag} must be an int (got {value!r})")
    if value < 1:
        raise SpecError(f"{flag} must be at least 1 (got {value})")
    if value > most:
        raise SpecError(f"{flag} must be in 1..{most} (got {value})")


def _items(items: Any) -> Any:
    """``--lora-paths`` / ``--lora-modules`` as ``parse_lora_paths`` takes them: objects a framework's own
    action made become dicts, SGLang's (``lora_name``, ``lora_path``, optionally ``pinned``) and vLLM's
    ``LoRAModulePath`` (``name``, ``path``, ``base_model_name``); the parser then checks their fields."""
    if not isinstance(items, (list, tuple)):
        return items
    out = []
    for item in items:
        if isinstance(item, (str, dict, LoRARef)):
            pass
        elif hasattr(item, "lora_name") and hasattr(item, "lora_path"):
            item = {
                "lora_name": item.lora_name,
                "lora_path": item.lora_path,
                "pinned": bool(getattr(item, "pinned", False)),
            }
        elif hasattr(item, "name") and hasattr(item, "path"):
            item = {
                "name": item.name,
                "path": item.path,
                "base_model_name": getattr(item, "base_model_name", None),
            }
        out.append(item)
    return out


def add_vllm_lora_args(
    parser: argparse.ArgumentParser, *, skip_existing: bool = True
) -> argparse.ArgumentParser:
    """Adds vLLM's LoRA flags with vLLM's defaults: ``--enable-lora``, ``--lora-modules`` (``NAME=PATH`` or
    JSON ``{"name", "path", "base_model_name"}`` items), ``--max-loras`` (1), ``--max-cpu-loras`` (default:
    ``--max-loras``), ``--max-lora-rank`` (16) and ``--lora-dtype`` (auto); returns ``parser``. Read them
    with :func:`lora_config_from_vllm_args`.

    Raises:
        argparse.ArgumentError: ``skip_existing`` is False and the parser already has one of these flags.
    """
    group = parser.add_argument_group("LoRA adapters (lora_pin, vLLM flags)")
    existing = set(parser._option_string_actions) if skip_existing else set()

    def add(flag: str, **kwargs: Any) -> None:
        if f"--{flag}" not in existing:
            group.add_argument(f"--{flag}", dest=_dest("", flag), **kwargs)

    add("enable-lora", action="store_true", default=False, help="Serve LoRA adapters (vLLM: required).")
    add(
        "lora-modules",
        nargs="+",
        default=None,
        metavar="ITEM",
        help='Start-up adapters: NAME=PATH or {"name": str, "path": str, "base_model_name": str|null}.',
    )
    add(
        "max-loras",
        type=int,
        default=VLLM_DEFAULT_MAX_LORAS,
        help="Device slots: distinct adapters one step can use (default %(default)s).",
    )
    add(
        "max-cpu-loras",
        type=int,
        default=None,
        help="Host-tier capacity in adapters (default: --max-loras). Must be >= --max-loras.",
    )
    add(
        "max-lora-rank",
        type=int,
        default=VLLM_DEFAULT_MAX_LORA_RANK,
        help="The slot pool's rank (default %(default)s).",
    )
    add(
        "lora-dtype",
        default="auto",
        choices=VLLM_LORA_DTYPES,
        help="The adapters' dtype; lora_pin computes in the model's, so only auto or the model's own dtype "
        "is served (default %(default)s).",
    )
    return parser


def lora_config_from_vllm_args(ns: argparse.Namespace) -> LoRAConfig | None:
    """The typed config from vLLM's LoRA flags (:func:`add_vllm_lora_args`), or None when ``--enable-lora``
    is not set (vLLM serves no adapter then). Every supported module of the model is wrapped (vLLM's rule),
    ``--max-loras`` are the device slots and ``--max-cpu-loras`` the host tier (default ``--max-loras``).

    Raises:
        SpecError: ``--lora-modules`` without ``--enable-lora``, an invalid item, a limit below 1, or
            ``--max-cpu-loras`` below ``--max-loras`` (the message gives the numbers).
    """
    enable = getattr(ns, "enable_lora", False)
    items = getattr(ns, "lora_modules", None)
    if not enable:
        if items:
            raise SpecError("--lora-modules needs --enable-lora (as in vLLM)")
        return None
    slots = getattr(ns, "max_loras", VLLM_DEFAULT_MAX_LORAS)
    _check_count("--max-loras", slots, MAX_SLOTS)
    loaded = getattr(ns, "max_cpu_loras", None)
    loaded = slots if loaded is None else loaded
    _check_count("--max-cpu-loras", loaded, 2**63 - 1)
    if loaded < slots:
        raise SpecError(f"--max-cpu-loras={loaded} must be >= --max-loras={slots}")
    rank = getattr(ns, "max_lora_rank", VLLM_DEFAULT_MAX_LORA_RANK)
    _check_count("--max-lora-rank", rank, MAX_ADAPTER_RANK)
    dtype = getattr(ns, "lora_dtype", "auto")
    if dtype not in VLLM_LORA_DTYPES:
        raise SpecError(f"--lora-dtype must be one of {VLLM_LORA_DTYPES} (got {dtype!r})")
    refs = tuple(parse_lora_paths(_items(items), max_loras_per_batch=slots, max_loaded_loras=loaded))
    return LoRAConfig(
        refs=refs,
        max_loras_per_batch=slots,
        max_loaded_loras=loaded,
        max_lora_rank=rank,
        target_modules=("all",),
        lora_dtype=dtype,
    )
