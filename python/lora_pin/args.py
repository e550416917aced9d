"""Server-args integration: ``add_lora_args`` puts lora_pin's flags on a framework's own parser, and
``lora_config_from_args`` turns the parsed namespace into one validated, typed :class:`LoRAConfig`.

A serving framework adds our flags in one line::

    lora_pin.add_lora_args(parser)
    config = lora_pin.lora_config_from_args(parser.parse_args())
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from lora_pin._core import EVICTION_POLICIES, MAX_SLOTS, LoRARef, parse_lora_paths
from lora_pin.errors import SpecError

__all__ = [
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "EVICTION_POLICIES",
    "LoRAConfig",
    "add_lora_args",
    "lora_config_from_args",
]

DEFAULT_MAX_LORAS_PER_BATCH = 8

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
    """

    refs: tuple[LoRARef, ...]
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    eviction_policy: str = "lru"

    @property
    def pinned(self) -> tuple[LoRARef, ...]:
        """The start-up adapters that are pinned."""
        return tuple(r for r in self.refs if r.pinned)


def add_lora_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--lora-paths``, ``--max-loras-per-batch``, ``--max-loaded-loras``, ``--max-lora-rank``,
    ``--lora-target-modules`` and ``--lora-eviction-policy`` to ``parser`` (in their own group); returns it.

    Raises:
        argparse.ArgumentError: the parser already has one of these flags.
    """
    group = parser.add_argument_group("LoRA adapters (lora_pin)")
    group.add_argument("--lora-paths", nargs="*", default=None, metavar="ITEM", help=_SPEC_HELP)
    group.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=DEFAULT_MAX_LORAS_PER_BATCH,
        help="Device slots: distinct adapters one step can use (default %(default)s).",
    )
    group.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="Host-tier capacity in adapters (default: unbounded). Must be >= --max-loras-per-batch.",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="The slot pool's rank (default: the largest start-up adapter's).",
    )
    group.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        metavar="MODULE",
        help="Modules to wrap, e.g. q_proj v_proj, or 'all' alone (default: the start-up adapters').",
    )
    group.add_argument(
        "--lora-eviction-policy",
        default="lru",
        choices=EVICTION_POLICIES,
        help="Device-tier eviction policy (default %(default)s).",
    )
    return parser


def lora_config_from_args(ns: argparse.Namespace) -> LoRAConfig:
    """Validates the namespace ``add_lora_args`` filled and returns the typed config.

    Raises:
        SpecError: an adapter item is invalid, the limits disagree (the message gives the numbers), a limit
            or the rank is below 1, ``all`` is not alone among the target modules, the eviction policy is
            unknown, or there are no start-up adapters and the rank or target modules are missing.
    """
    slots = ns.max_loras_per_batch
    loaded = ns.max_loaded_loras
    # Checked here with the flag's name: past 2^64 the core could not even take the number.
    if not 1 <= slots <= MAX_SLOTS:
        raise SpecError(f"--max-loras-per-batch must be in 1..{MAX_SLOTS} (got {slots})")
    if loaded is not None and not 1 <= loaded < 2**63:
        raise SpecError(f"--max-loaded-loras must be in 1..{2**63 - 1} (got {loaded})")
    refs = tuple(parse_lora_paths(ns.lora_paths, max_loras_per_batch=slots, max_loaded_loras=loaded))
    rank = ns.max_lora_rank
    if rank is not None and rank < 1:
        raise SpecError(f"--max-lora-rank must be at least 1 (got {rank})")
    targets = None if ns.lora_target_modules is None else tuple(ns.lora_target_modules)
    if targets is not None:
        if not targets:
            raise SpecError("--lora-target-modules was given without any module")
        blank = [t for t in targets if not t.strip()]
        if blank:
            raise SpecError(f"--lora-target-modules has an empty module name: {list(targets)!r}")
        if "all" in targets and len(targets) > 1:
            raise SpecError(f"--lora-target-modules: 'all' must stand alone (got {list(targets)!r})")
    if not refs and (rank is None or targets is None):
        raise SpecError(
            "with no --lora-paths, both --max-lora-rank and --lora-target-modules are required to size the "
            f"slot pool (got --max-lora-rank={rank}, --lora-target-modules={targets})"
        )
    policy = ns.lora_eviction_policy
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
