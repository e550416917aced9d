"""The host tier: adapters validated against the model and normalised into CPU tensors per target group.

For each target group an adapter touches (by the group's key, ``model.layers.0.self_attn.qkv_proj``),
:class:`HostModule` holds A ``[n_slices * rank, in]`` and B ``[out_total, rank]`` in the serving dtype, laid
out like a device pool slot with ``rank`` (the largest rank among the group's slices in this adapter) in
place of the pool's max rank: slice s has A rows
``[s * rank, s * rank + r_s)`` and B rows ``[off_s, off_{s+1})``, columns ``[0, r_s)``; everything else is
zero, so a slice the adapter lacks contributes nothing. The tensors are page-locked when CUDA is available,
so copies into the device pool can be asynchronous.

Weights that are NaN or infinite after conversion to the serving dtype (also finite values that overflow it,
e.g. 1e5 in float16) are refused, not warned about: one such value turns every output of every request
using the adapter into NaN, and nothing downstream could tell a user why.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lora_pin.errors import AdapterLoadError, AdapterNotFoundError, DuplicateAdapterError
from lora_pin.weights.config import AdapterConfig
from lora_pin.weights.digest import ServedModule, adapter_digest
from lora_pin.weights.dora import (
    BaseWeights,
    checked_factor,
    dora_factor,
    dora_norm_sq,
    factor_nbytes,
    module_slices,
)
from lora_pin.weights.limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_TENSORS
from lora_pin.weights.reader import PEFT_PREFIX, AdapterFile, LoraTensorPair, open_adapter
from lora_pin.weights.targets import LinearTarget, LoRATargets, TargetGroup
from lora_pin.weights.tensors import AdapterTensors

if TYPE_CHECKING:
    from lora_pin.parallel.sharding import ShardPlan

__all__ = ["HostAdapter", "HostModule", "HostTier", "load_adapter", "load_opened"]

_LISTED = 8


def _listing(names: Iterable[str]) -> str:
    items = sorted(names)
    shown = ", ".join(repr(n) for n in items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


@dataclass(frozen=True)
class HostModule:
    """One adapter's weights for one target group.

    ``a``: ``[n_slices * rank, in]``; ``b``: ``[out_total, rank]``; ``ranks`` / ``scalings``: per slice
    (0 and 0.0 for a slice the adapter does not target), also as the int32 / float32 ``[n_slices]``
    tensors ``rank_tensor`` / ``scaling_tensor`` the pool copies.

    A DoRA adapter's module also holds ``magnitude``, float32 ``[out_total]`` (its
    ``lora_magnitude_vector`` on the rows of the slices it targets, 0 elsewhere), and, once computed
    against the model's base weight, ``factor``, float32 ``[out_total]`` (:func:`~lora_pin.weights.dora.
    dora_factor`: ``m / ||W + s B A||`` per output feature, 1 on the slices it does not target), which
    the pool copies beside A and B. Both None for plain LoRA. On a tensor-parallel rank a column
    layer's magnitudes and factors are its output rows'; a row-parallel layer's factor waits, None, for
    the other ranks' parts of its squared norms, this rank's part held in ``norm_sq`` (float32
    ``[out_total]``) until :func:`~lora_pin.weights.dora.finish_factors` completes them.
    """

    group: TargetGroup
    a: torch.Tensor
    b: torch.Tensor
    ranks: tuple[int, ...]
    scalings: tuple[float, ...]
    rank_tensor: torch.Tensor
    scaling_tensor: torch.Tensor
    magnitude: torch.Tensor | None = None
    factor: torch.Tensor | None = None
    norm_sq: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """The A rows reserved per slice (the largest slice rank)."""
        return self.a.shape[0] // self.group.n_slices


def _dora_nbytes(module: HostModule) -> int:
    return sum(t.nbytes for t in (module.magnitude, module.factor) if t is not None)


def _whole_dora_nbytes(module: HostModule, shards: ShardPlan | None) -> int:
    """:func:`_dora_nbytes` of ``module`` on an unsharded model: the same on every tensor-parallel rank
    (a row-parallel factor still pending counts as the factor it becomes)."""
    if module.magnitude is None:
        return 0
    full_out = 0
    for member in module.group.members:
        shard = None if shards is None else shards.member(member.key)
        full_out += member.out_features if shard is None else shard.full_out
    held = 1 + (module.factor is not None or module.norm_sq is not None)
    return held * full_out * module.magnitude.element_size()


@dataclass(frozen=True)
class HostAdapter:
    """One adapter in the host tier: its :class:`HostModule` per target group key it touches.

    Groups it does not touch are absent (the pool zeroes them). ``targets`` is the model description it was
    validated against; ``tensors_applied`` counts the file's tensors that were used (all of them).
    ``digest`` is the adapter's content digest (:mod:`lora_pin.weights.digest`: 64 hex characters, the
    same for the same weights whatever the folder, format, process or tensor-parallel rank), and
    ``whole_nbytes`` the host bytes of the whole adapter unsharded (:attr:`nbytes` on a single process;
    on a tensor-parallel rank, which holds only its shard, the same figure on every rank).
    """

    name: str
    path: Path
    config: AdapterConfig
    targets: LoRATargets
    dtype: torch.dtype
    modules: Mapping[str, HostModule]
    tensors_applied: int
    digest: str
    whole_nbytes: int

    @property
    def max_rank(self) -> int:
        """The largest rank of any module (what the pool's max rank must hold)."""
        return max(max(m.ranks) for m in self.modules.values())

    @property
    def ranks(self) -> tuple[int, ...]:
        """The distinct ranks of the adapter's modules, ascending."""
        return tuple(sorted({r for m in self.modules.values() for r in m.ranks if r}))

    @property
    def dora(self) -> bool:
        """Whether this is a DoRA adapter (its modules carry magnitudes and factors)."""
        return self.config.use_dora

    @property
    def nbytes(self) -> int:
        """Host bytes held (A and B of every module, zero padding of fused slices included, and a DoRA
        adapter's magnitudes and factors)."""
        return sum(m.a.nbytes + m.b.nbytes + _dora_nbytes(m) for m in self.modules.values())

    @property
    def device_bytes(self) -> int:
        """Bytes of the adapter's own weights at their own ranks, in the serving dtype (no padding), and
        of a DoRA adapter's factors (one per output feature of each group it touches).

        A :class:`~lora_pin.weights.pool.DevicePool` slot holds ``pool.slot_nbytes`` whatever the adapter.
        """
        size = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for module in self.modules.values():
            group = module.group
            widths = group.slice_widths
            for s, rank in enumerate(module.ranks):
                member = group.members[0 if group.experts else s]
                total += rank * (member.in_features + widths[s]) * size
            if module.magnitude is not None:
                total += factor_nbytes(module.b.shape[0], self.dtype)
        return total

    @property
    def pinned(self) -> bool:
        """Whether every host tensor is page-locked."""
        return all(m.a.is_pinned() and m.b.is_pinned() for m in self.modules.values())


def _expert_pairs(file: AdapterFile, targets: LoRATargets) -> dict[str, LoraTensorPair]:
    """The tensor pair of every MoE expert weight the adapter's ``target_parameters`` name, by parameter key.

    PEFT wraps each targeted parameter of one experts module in a nested wrapper, the first in the
    module's parameter order innermost, and saves each wrapper's tensors under its own path: with
    ``gate_up_proj`` and ``down_proj`` targeted, ``...experts.base_layer.lora_A.weight`` is
    ``gate_up_proj``'s and ``...experts.lora_A.weight`` is ``down_proj``'s. The targets list an experts
    module's weights in that parameter order.

    Raises:
        AdapterLoadError: an entry names no expert weight this model serves (with the reason when the model
            has it but it is not served), or a named weight has no tensors.
    """
    config, where = file.config, f"adapter {file.name!r} ({file.config.file})"
    if not config.target_parameters:
        return {}
    served = [t for t in targets.linears if t.experts]
    for entry in config.target_parameters:
        if not any(t.key == entry or t.key.endswith(f".{entry}") for t in served):
            unserved = [k for k in targets.unserved if k == entry or k.endswith(f".{entry}")]
            raise AdapterLoadError(
                f"{where}: field 'target_parameters' names {entry!r}, "
                + (
                    _why_not_target(targets, unserved)
                    if unserved
                    else "which is not a MoE expert weight lora_pin serves in this model (served: "
                    f"{_listing(t.key for t in served) or 'none'})"
                )
            )
    if refused := [k for k in targets.unserved if config.targets_parameter(k)]:
        raise AdapterLoadError(
            f"{where}: field 'target_parameters' names expert weight " + _why_not_target(targets, refused)
        )
    by_module: dict[str, list[LinearTarget]] = {}
    for t in served:
        if config.targets_parameter(t.key):
            by_module.setdefault(t.key.rpartition(".")[0], []).append(t)
    found: dict[str, LoraTensorPair] = {}
    for module_key, members in by_module.items():
        for depth, target in enumerate(reversed(members)):
            stored_key = module_key + ".base_layer" * depth
            pair = file.pairs.get(stored_key)
            if pair is None:
                raise AdapterLoadError(
                    f"adapter {file.name!r} ({file.weights_path}): the config targets expert weight "
                    f"{target.key!r}, which has no tensors {PEFT_PREFIX}{stored_key}.lora_A.weight / "
                    "lora_B.weight"
                )
            found[target.key] = pair
    return found


def _check_expert_pair(file: AdapterFile, pair: LoraTensorPair, target: LinearTarget, max_rank: int) -> int:
    """The rank of an expert weight's pair: PEFT's A ``[r * E, in]`` and B ``[out, r * E]`` (A
    ``[r * E, out]`` and B ``[in, r * E]`` for a ``peft_swapped`` target)."""
    where = f"adapter {file.name!r} ({file.weights_path})"
    experts = target.experts
    stacked = pair.a_shape[0]
    a_width, b_height = target.in_features, target.out_features
    if target.peft_swapped:
        a_width, b_height = b_height, a_width
    if (
        pair.embedding
        or stacked % experts
        or pair.a_shape != (stacked, a_width)
        or pair.b_shape != (b_height, stacked)
    ):
        raise AdapterLoadError(
            f"{where}: tensors {pair.a_name!r} {list(pair.a_shape)} / {pair.b_name!r} {list(pair.b_shape)} "
            f"do not fit expert weight {target.key!r} ({experts} experts, in={target.in_features}, "
            f"out={target.out_features}): expected lora_A [r * {experts}, {a_width}] and "
            f"lora_B [{b_height}, r * {experts}]"
        )
    rank = stacked // experts
    configured = file.config.rank_for(target.key)
    if rank != configured:
        raise AdapterLoadError(
            f"{where}: tensor {pair.a_name!r} has rank {rank} per expert but field 'r'/'rank_pattern' "
            f"gives {configured} for expert weight {target.key!r}"
        )
    if rank > max_rank:
        raise AdapterLoadError(
            f"{where}: expert weight {target.key!r} has rank {rank}, above the pool's max rank {max_rank} "
            "(field 'r'/'rank_pattern')"
        )
    return rank


def _check_against_model(
    file: AdapterFile, targets: LoRATargets, max_rank: int, shards: ShardPlan | None = None
) -> tuple[dict[str, int], dict[str, LoraTensorPair]]:
    """Validate the adapter's modules against the model; return the rank of each target key it touches
    and the tensor pair of each (keyed by module key, or by parameter key for an expert weight)."""
    name, config, where = file.name, file.config, f"adapter {file.name!r} ({file.weights_path})"
    expert_pairs = _expert_pairs(file, targets)
    if expert_pairs and shards is not None:
        raise AdapterLoadError(
            f"{where}: field 'target_parameters' puts LoRA on MoE expert weights "
            f"({_listing(expert_pairs)}), which lora_pin does not serve under tensor parallelism; serve "
            "this adapter on an unsharded model, or train it without target_parameters"
        )
    stored_expert_keys = {p.module_key for p in expert_pairs.values()}
    known = [t.key for t in targets.linears if not t.experts]
    if isinstance(config.target_modules, tuple):
        for entry in sorted(config.target_modules):
            if not any(k == entry or k.endswith(f".{entry}") for k in known):
                raise AdapterLoadError(
                    f"adapter {name!r} ({config.file}): field 'target_modules' names {entry!r}, "
                    + _why_not_target(
                        targets, [k for k in targets.unserved if k == entry or k.endswith(f".{entry}")]
                    )
                )
    pairs = {k: p for k, p in file.pairs.items() if k not in stored_expert_keys}
    known_set = set(known)
    matched = [k for k in pairs if k in known_set]
    stray_modules = [k for k in pairs if k not in known_set]
    if explained := [k for k in stray_modules if k in targets.unserved]:
        raise AdapterLoadError(f"{where}: it has tensors for module " + _why_not_target(targets, explained))
    if not matched and not expert_pairs:
        raise AdapterLoadError(
            f"{where}: no tensor matches any LoRA target of this model (it would silently serve base-model "
            f"output); tensors found for modules {_listing(pairs) or 'none'}"
        )
    strays = [n for k in stray_modules for n in (pairs[k].a_name, pairs[k].b_name)]
    unused = [n for n in file.unused if not _is_base_copy(file, targets, n)]
    if unused or strays:
        raise AdapterLoadError(
            f"{where}: {len(unused) + len(strays)} tensor(s) would be unused: {_listing(unused + strays)}"
        )
    expected = {k for k in known if config.targets(k)}
    if missing := expected - pairs.keys():
        raise AdapterLoadError(
            f"{where}: the config targets modules with no lora_A/lora_B tensors: {_listing(missing)}"
        )
    if extra := pairs.keys() - expected:
        raise AdapterLoadError(
            f"{where}: tensors for modules the config's target_modules/layers_to_transform exclude: "
            f"{_listing(extra)}"
        )
    # PEFT ignores a key that matches nothing; it is a typo that silently serves the default r/alpha.
    for field_name, pattern_key in config.unused_pattern_keys([*expected, *expert_pairs]):
        raise AdapterLoadError(
            f"adapter {name!r} ({config.file}): field {field_name!r} key {pattern_key!r} matches no "
            f"module the adapter targets ({_listing([*expected, *expert_pairs])})"
        )
    ranks: dict[str, int] = {}
    for key in matched:
        pair, target = pairs[key], targets.linear(key)
        assert target is not None
        ranks[key] = _check_pair(file, pair, target, max_rank, shards)
    for key, pair in expert_pairs.items():
        target = targets.linear(key)
        assert target is not None
        ranks[key] = _check_expert_pair(file, pair, target, max_rank)
    _check_dora(file, targets, {k: pairs[k] for k in matched}, shards)
    return ranks, {k: pairs[k] for k in matched} | expert_pairs


def _check_dora(
    file: AdapterFile, targets: LoRATargets, pairs: dict[str, LoraTensorPair], shards: ShardPlan | None
) -> None:
    """A DoRA adapter (``use_dora``) has one ``lora_magnitude_vector`` ``[out]`` per targeted linear; a
    plain one has none. DoRA on an embedding (PEFT scales its lookup differently) is refused by name.

    Raises:
        AdapterLoadError: naming the adapter, the file and the module or tensor.
    """
    where = f"adapter {file.name!r} ({file.weights_path})"
    if not file.config.use_dora:
        if magnitudes := [p.magnitude_name for p in pairs.values() if p.magnitude_name is not None]:
            raise AdapterLoadError(
                f"{where}: tensor(s) {_listing(magnitudes)} are DoRA magnitudes, but the config's field "
                "'use_dora' is not true (a DoRA adapter with a wrong config, or a plain one with stray "
                "tensors)"
            )
        return
    if shards is not None and shards.tp.fully_sharded:
        raise AdapterLoadError(
            f"{where}: field 'use_dora' is true; lora_pin does not serve DoRA adapters with fully sharded "
            "tensor parallelism (a rank holds only a chunk of A's or B's rank, and a DoRA norm needs the "
            "whole product B A of its rows); serve it with TensorParallel(fully_sharded=False)"
        )
    for key, pair in pairs.items():
        if pair.embedding:
            raise AdapterLoadError(
                f"{where}: DoRA on embedding {key!r} cannot be served (field 'use_dora' is true and it "
                "targets an embedding; lora_pin serves DoRA on linear layers only)"
            )
        target = targets.linear(key)
        assert target is not None
        if pair.magnitude_name is None:
            raise AdapterLoadError(
                f"{where}: field 'use_dora' is true (DoRA) but module {key!r} has no tensor "
                f"{PEFT_PREFIX}{key}.lora_magnitude_vector"
            )
        shard = None if shards is None else shards.member(key)
        out_features = target.out_features if shard is None else shard.full_out
        if pair.magnitude_shape != (out_features,):
            raise AdapterLoadError(
                f"{where}: tensor {pair.magnitude_name!r} has shape {list(pair.magnitude_shape or ())}, "
                f"expected [{out_features}] (one magnitude per output feature of module {key!r})"
            )


def _is_base_copy(file: AdapterFile, targets: LoRATargets, tensor_name: str) -> bool:
    """Whether ``tensor_name`` is PEFT's copy of a targeted embedding's or output layer's base weight
    (``<module>.base_layer.weight``, saved when ``target_modules`` names one) equal to the model's.

    Raises:
        AdapterLoadError: it is such a copy, but its shape or values (in the model's dtype) differ from the
            model's weight: a resized or retrained layer, whose adapter the model's weight cannot serve.
    """
    module_key = tensor_name.removeprefix(PEFT_PREFIX).removesuffix(".base_layer.weight")
    weight = targets.base_weights.get(module_key)
    if weight is None or tensor_name != f"{PEFT_PREFIX}{module_key}.base_layer.weight":
        return False
    stored = file.tensor(tensor_name)
    if tuple(stored.shape) != tuple(weight.shape) or not torch.equal(
        stored.to(device=weight.device, dtype=weight.dtype), weight.detach()
    ):
        raise AdapterLoadError(
            f"adapter {file.name!r} ({file.weights_path}): tensor {tensor_name!r} {list(stored.shape)}, "
            f"PEFT's copy of module {module_key!r}'s base weight, differs from the model's "
            f"{list(weight.shape)} (a resized or retrained layer is not served)"
        )
    return True


def _why_not_target(targets: LoRATargets, unserved: list[str]) -> str:
    """Why the module(s) ``unserved`` (keys of the model that are no targets, maybe none) cannot be served."""
    if not unserved:
        return (
            "which is not a LoRA target of this model: no linear layer it wraps has that name (targets: "
            f"{', '.join(targets.module_names)})"
        )
    more = f" (and {len(unserved) - 1} more)" if len(unserved) > 1 else ""
    return f"{unserved[0]!r}{more}, which is not served: {targets.unserved[unserved[0]]}"


def _check_pair(
    file: AdapterFile, pair: LoraTensorPair, target: LinearTarget, max_rank: int, shards: ShardPlan | None
) -> int:
    where = f"adapter {file.name!r} ({file.weights_path})"
    # A tensor-parallel rank's module is a shard of the layer the adapter was trained on: the stored tensors
    # have the unsharded widths, of which this rank reads its part.
    shard = None if shards is None else shards.member(target.key)
    in_features = target.in_features if shard is None else shard.full_in
    out_features = target.out_features if shard is None else shard.full_out
    if pair.embedding != target.embedding:
        held, actual, expected = (
            ("an embedding's", "a linear layer", "lora_A/lora_B")
            if pair.embedding
            else ("a linear layer's", "an embedding", "lora_embedding_A/lora_embedding_B")
        )
        raise AdapterLoadError(
            f"{where}: tensors {pair.a_name!r} / {pair.b_name!r} are {held}, but module {target.key!r} "
            f"is {actual} (expected {expected})"
        )
    rank = pair.a_shape[0]
    if pair.a_shape != (rank, in_features) or pair.b_shape != (out_features, rank):
        raise AdapterLoadError(
            f"{where}: tensors {pair.a_name!r} {list(pair.a_shape)} / {pair.b_name!r} {list(pair.b_shape)} "
            f"do not fit module {target.key!r} (in={in_features}, out={out_features}): "
            f"expected [r, {in_features}] and [{out_features}, r]"
        )
    configured = file.config.rank_for(target.key)
    if rank != configured:
        raise AdapterLoadError(
            f"{where}: tensor {pair.a_name!r} has rank {rank} but field 'r'/'rank_pattern' gives "
            f"{configured} for module {target.key!r}"
        )
    if rank > max_rank:
        raise AdapterLoadError(
            f"{where}: module {target.key!r} has rank {rank}, above the pool's max rank {max_rank} "
            "(field 'r'/'rank_pattern')"
        )
    return rank


class _Slab:
    """One allocation per adapter, handed out as views: one (pinned) allocation instead of one per tensor,
    which avoids an mmap/munmap and fresh page faults for every large tensor."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.memory = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.used = 0

    def take(self, shape: tuple[int, int], zero: bool) -> torch.Tensor:
        numel = shape[0] * shape[1]
        view = self.memory[self.used : self.used + numel].view(shape)
        self.used += numel
        return view.zero_() if zero else view


def _group_ranks(group: TargetGroup, ranks: dict[str, int]) -> tuple[int, ...]:
    if group.experts:
        return (ranks.get(group.members[0].key, 0),) * group.experts
    return tuple(ranks.get(m.key, 0) for m in group.members)


def _module_shape(group: TargetGroup, rank: int, shards: ShardPlan | None) -> tuple[int, int, int]:
    """``(a_rank, b_out, b_rank)``: A ``[n_slices * a_rank, in]`` and B ``[b_out, b_rank]``."""
    return (rank, group.out_total, rank) if shards is None else shards.host_shape(group, rank)


def _group_numel(group: TargetGroup, ranks: dict[str, int], shards: ShardPlan | None) -> int:
    a_rank, b_out, b_rank = _module_shape(group, max(_group_ranks(group, ranks)), shards)
    return a_rank * group.n_slices * group.in_features + b_out * b_rank


def _whole_numel(group: TargetGroup, ranks: dict[str, int], shards: ShardPlan | None) -> int:
    """The elements of ``group``'s host module on an unsharded model: :func:`_group_numel` without
    ``shards``, from the layers' unsharded widths (alike on every tensor-parallel rank)."""
    if shards is None:
        return _group_numel(group, ranks, None)
    rank = max(_group_ranks(group, ranks))
    full_in, full_out = group.in_features, 0
    for member in group.members:
        shard = shards.member(member.key)
        full_in = full_in if shard is None else shard.full_in
        full_out += member.out_features if shard is None else shard.full_out
    return rank * group.n_slices * full_in + full_out * rank


# One group's build: the group, A, B, and per slice its rank and scaling.
_Built = tuple[TargetGroup, torch.Tensor, torch.Tensor, tuple[int, ...], tuple[float, ...]]


def _build_module(
    file: AdapterFile,
    group: TargetGroup,
    ranks: dict[str, int],
    pairs: dict[str, LoraTensorPair],
    slab: _Slab,
    reads: list[tuple[str, torch.Tensor]],
    shards: ShardPlan | None = None,
) -> _Built:
    """``group``'s A and B in views of ``slab``, their padding zeroed, and its slices' ranks and scalings;
    the tensors read straight into those views are added to ``reads`` (the caller reads them all in one
    call), the others are read here."""
    slice_ranks = _group_ranks(group, ranks)
    if group.experts:
        scaling = file.config.scaling_for(group.key, slice_ranks[0])
        scalings: tuple[float, ...] = (scaling,) * group.experts
    else:
        scalings = tuple(
            file.config.scaling_for(m.key, r) if r else 0.0
            for m, r in zip(group.members, slice_ranks, strict=True)
        )
    rank = max(slice_ranks)
    a_rank, b_out, b_rank = _module_shape(group, rank, shards)
    cut = shards is not None and any(
        (m := shards.member(member.key)) is not None and m.cut_rank for member in group.members
    )
    padded = cut or any(r != rank for r in slice_ranks)
    a = slab.take((group.n_slices * a_rank, group.in_features), padded)
    b = slab.take((b_out, b_rank), padded)
    offsets = group.slice_offsets if shards is None else shards.b_offsets(group)
    if group.experts:
        _read_experts(file, pairs[group.key], group.experts, a, b, group.members[0].peft_swapped)
    for s, member in enumerate(() if group.experts else group.members):
        if not slice_ranks[s]:
            continue
        pair = pairs[member.key]
        b_cols = b[offsets[s] : offsets[s + 1], : slice_ranks[s]]
        shard = None if shards is None else shards.member(member.key)
        if shard is None:
            reads.append((pair.a_name, a[s * a_rank : s * a_rank + slice_ranks[s]]))
            reads.append((pair.b_name, b_cols))
            continue
        # This rank's part only: A's columns of its input shard (and its chunk of the rank's rows when
        # fully sharded), B's rows of its output shard.
        chunk = shards.rank_chunk if shards is not None and shard.cut_rank else 0
        first, last = shard.a_rows(slice_ranks[s], chunk)
        a_part = a[s * a_rank : s * a_rank + last - first]
        file.read_slice_into(pair.a_name, a_part, (first, last), shard.a_cols)
        file.read_slice_into(pair.b_name, b_cols, shard.b_rows, (0, slice_ranks[s]))
    return group, a, b, slice_ranks, scalings


def _host_modules(
    file: AdapterFile,
    pairs: dict[str, LoraTensorPair],
    built: list[_Built],
    pin: bool,
    shards: ShardPlan | None = None,
) -> dict[str, HostModule]:
    """Each built group's :class:`HostModule`, by group key, with a DoRA adapter's magnitudes; every
    group's ``rank_tensor`` and ``scaling_tensor`` are views of one tensor each (two allocations per
    adapter, not two per group)."""
    ranks = torch.tensor([r for *_, slice_ranks, _ in built for r in slice_ranks], dtype=torch.int32)
    scalings = torch.tensor([x for *_, slice_scalings in built for x in slice_scalings], dtype=torch.float32)
    if pin:
        ranks, scalings = ranks.pin_memory(), scalings.pin_memory()
    counts = [len(slice_ranks) for *_, slice_ranks, _ in built]
    return {
        group.key: HostModule(
            group,
            a,
            b,
            slice_ranks,
            slice_scalings,
            rank_tensor,
            scaling_tensor,
            _read_magnitude(file, group, slice_ranks, pairs, b.shape[0], shards)
            if file.config.use_dora
            else None,
        )
        for (group, a, b, slice_ranks, slice_scalings), rank_tensor, scaling_tensor in zip(
            built, ranks.split(counts), scalings.split(counts), strict=True
        )
    }


def _read_magnitude(
    file: AdapterFile,
    group: TargetGroup,
    slice_ranks: tuple[int, ...],
    pairs: dict[str, LoraTensorPair],
    out_total: int,
    shards: ShardPlan | None = None,
) -> torch.Tensor:
    """A DoRA module's magnitudes, float32 ``[out_total]`` (0 on the rows of slices it does not target;
    with ``shards``, this rank's output rows of each slice).

    Raises:
        AdapterLoadError: a magnitude is NaN or infinite (every output of the layer would be).
    """
    magnitude = torch.zeros(out_total, dtype=torch.float32)
    offsets = group.slice_offsets
    for s, member in enumerate(group.members):
        if not slice_ranks[s]:
            continue
        name = pairs[member.key].magnitude_name
        assert name is not None, "_check_dora let a DoRA module without magnitude through"
        stored = file.tensor(name, record=True)
        bad = int((~torch.isfinite(stored)).sum())
        if bad:
            raise AdapterLoadError(
                f"adapter {file.name!r} ({file.weights_path}): tensor {name!r} has {bad} NaN/Inf "
                "value(s); refused"
            )
        shard = None if shards is None else shards.member(member.key)
        rows = stored if shard is None else stored[shard.b_rows[0] : shard.b_rows[1]]
        magnitude[offsets[s] : offsets[s + 1]] = rows.to(torch.float32)
    return magnitude


def _with_factors(
    file: AdapterFile, modules: dict[str, HostModule], base_weights: BaseWeights, shards: ShardPlan | None
) -> dict[str, HostModule]:
    """The DoRA ``modules`` with their factors computed against the model's ``base_weights``; with
    ``shards``, a row-parallel group's with this rank's part of its squared norms instead (see
    :class:`HostModule`).

    Raises:
        AdapterLoadError: a module's base weight cannot be read (its layer keeps no plain ``[out, in]``
            weight) or has another shape, or a factor is not finite (a row of ``W + s B A`` of norm zero,
            or a magnitude too large for float32).
    """
    where = f"adapter {file.name!r} ({file.weights_path})"
    done = {}
    for key, module in modules.items():
        group = module.group
        weight_of = base_weights.get(key)
        weight = None if weight_of is None else weight_of()
        if weight is None or tuple(weight.shape) != (group.out_total, group.in_features):
            shape = "none" if weight is None else str(list(weight.shape))
            raise AdapterLoadError(
                f"{where}: DoRA on {key!r} cannot be served: the norm needs the layer's base weight as "
                f"[{group.out_total}, {group.in_features}], and its layer has {shape}"
            )
        slices = module_slices(module)
        assert module.magnitude is not None
        shard = None if shards is None else shards.group(key)
        with torch.no_grad():
            if shard is not None and shard.layout.kind == "row":
                done[key] = replace(module, norm_sq=dora_norm_sq(weight.detach(), module.a, module.b, slices))
                continue
            factor = dora_factor(weight.detach(), module.a, module.b, slices, module.magnitude)
        checked_factor(where, key, factor)
        done[key] = replace(module, factor=factor.pin_memory() if module.a.is_pinned() else factor)
    return done


def _read_experts(
    file: AdapterFile,
    pair: LoraTensorPair,
    experts: int,
    a: torch.Tensor,
    b: torch.Tensor,
    peft_swapped: bool,
) -> None:
    """Put an expert weight's PEFT tensors into an experts group's A ``[E * r, in]`` and B ``[E * out, r]``.

    PEFT's A ``[r * E, in]`` holds expert e's rows at ``[e * r, (e + 1) * r)``, the pool's layout already;
    its B ``[out, r * E]`` holds expert e's column j at ``j * E + e`` (``lora_B.weight`` reshaped
    ``[out, r, E]``), so B is regrouped expert by expert. For a ``peft_swapped`` weight, PEFT's delta
    ``B_e A_e`` is ``[in, out]``: expert e's A is then PEFT's B_e transposed and its B PEFT's A_e transposed.
    """
    out_features, rank = b.shape[0] // experts, b.shape[1]
    in_features = a.shape[1]
    if peft_swapped:
        stored_b = file.tensor(pair.b_name, record=True)  # [in, r * E]
        a.view(experts, rank, in_features).copy_(stored_b.view(in_features, rank, experts).permute(2, 1, 0))
        stored_a = file.tensor(pair.a_name, record=True)  # [r * E, out]
        b.view(experts, out_features, rank).copy_(stored_a.view(experts, rank, out_features).permute(0, 2, 1))
        return
    file.read_into(pair.a_name, a)
    stored = file.tensor(pair.b_name, record=True)
    b.view(experts, out_features, rank).copy_(stored.view(out_features, rank, experts).permute(2, 0, 1))


def _slices(module: HostModule, pairs: dict[str, LoraTensorPair]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each stored tensor's name and the view of ``module``'s A or B that holds it (an expert weight's
    whole A and B: its tensors hold every expert)."""
    rank, group = module.rank, module.group
    # A tensor-parallel rank's B may hold one output shard of a single slice (fully sharded row layer).
    offsets = group.slice_offsets if module.b.shape[0] == group.out_total else (0, module.b.shape[0])
    if group.experts:
        pair = pairs[module.group.key]
        swapped = group.members[0].peft_swapped
        yield (pair.b_name if swapped else pair.a_name), module.a
        yield (pair.a_name if swapped else pair.b_name), module.b
        return
    for s, (member, r) in enumerate(zip(group.members, module.ranks, strict=True)):
        if r:
            pair = pairs[member.key]
            yield pair.a_name, module.a[s * rank : s * rank + min(r, rank)]
            yield pair.b_name, module.b[offsets[s] : offsets[s + 1], :r]


def _refuse_non_finite(
    file: AdapterFile,
    pairs: dict[str, LoraTensorPair],
    slab: _Slab,
    modules: Iterable[HostModule],
    searched: list[tuple[tuple[str, torch.Tensor], int | None]],
    tensors: int,
) -> None:
    """Refuse a NaN/Inf anywhere in the slab, naming the first tensor that holds one.

    ``searched`` pairs each read of :meth:`~lora_pin.weights.reader.AdapterFile.read_many` with the
    count of NaN/Inf the core found in it while reading (None where it did not search). When those
    searches cover all ``tensors`` of the slab (every element of it is a weight or zero padding), they
    are the whole check. Otherwise one pass over the whole slab instead of one call per tensor; the
    tensors are searched only once the slab is known to hold such a value. The pass is ``aminmax``: NaN
    propagates to both ends and an infinity is one of them, and unlike ``isfinite`` it allocates no mask
    (about 20x faster on a few MiB).
    """
    for (tensor_name, copied), bad in searched:
        if bad:
            raise _non_finite(file, tensor_name, copied, bad)
    if len(searched) == tensors and all(bad is not None for _, bad in searched):
        return
    low, high = torch.aminmax(slab.memory)
    if math.isfinite(low.item()) and math.isfinite(high.item()):
        return
    for module in modules:
        for tensor_name, copied in _slices(module, pairs):
            bad = int((~torch.isfinite(copied)).sum())
            if bad:
                raise _non_finite(file, tensor_name, copied, bad)
    raise AssertionError("a NaN/Inf in the slab outside every tensor's view")


def _non_finite(file: AdapterFile, tensor_name: str, copied: torch.Tensor, bad: int) -> AdapterLoadError:
    return AdapterLoadError(
        f"adapter {file.name!r} ({file.weights_path}): tensor {tensor_name!r} has {bad} "
        f"NaN/Inf value(s) in the serving dtype {copied.dtype} (stored as {file.dtype}); refused"
    )


def _served(modules: Iterable[HostModule], pairs: dict[str, LoraTensorPair]) -> Iterator[ServedModule]:
    """Every module the adapter serves, with its rank, scaling and tensors (what its digest covers)."""
    for module in modules:
        group = module.group
        if group.experts:
            pair = pairs[group.key]
            yield ServedModule(group.key, module.ranks[0], module.scalings[0], pair.a_name, pair.b_name)
            continue
        for member, rank, scaling in zip(group.members, module.ranks, module.scalings, strict=True):
            if rank:
                pair = pairs[member.key]
                yield ServedModule(member.key, rank, scaling, pair.a_name, pair.b_name, pair.magnitude_name)


def load_adapter(
    name: str,
    path: str | os.PathLike[str],
    targets: LoRATargets,
    *,
    max_rank: int,
    dtype: torch.dtype,
    allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
    allow_pickle: bool = False,
    pin_memory: bool | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
    shards: ShardPlan | None = None,
    base_weights: BaseWeights | None = None,
) -> HostAdapter:
    """Read, validate and normalise the PEFT adapter at ``path`` into host tensors for ``targets``.

    Every check runs before any host tensor is built, and nothing outside the returned object changes, so a
    failure leaves the caller's state as it was. ``pin_memory`` defaults to ``torch.cuda.is_available()``.
    Tensor shapes: per touched group A ``[n_slices * rank, in]``, B ``[out_total, rank]``
    (see :class:`HostModule`). With ``shards`` (a tensor-parallel rank's
    :class:`~lora_pin.parallel.sharding.ShardPlan`) the stored tensors are checked at their unsharded shapes
    and only this rank's part of each is read from the file and kept. A DoRA adapter's factors
    (:mod:`lora_pin.weights.dora`) are computed against ``base_weights`` (group key -> the model's base
    weight ``[out_total, in]``, on its device), once; without it they are left None (the adapter is then
    for inspection, not for a device pool).

    Raises:
        PathNotAllowedError: ``path`` (or a file in it) resolves outside ``allowed_roots``, or has ``..``.
        UnsafeFormatError: the weights are ``adapter_model.bin`` and ``allow_pickle`` is False.
        AdapterLoadError: a refused config field (DoRA, bias, modules_to_save, non-LORA ...), a target
            module the model lacks, a rank above ``max_rank`` or different from the config's, a tensor shape
            that does not fit its module, tensors matching no module, any unused tensor, or a targeted module
            without tensors; a weight file above ``max_file_bytes`` or with more than ``max_tensors``
            tensors (checked before any tensor is read); a NaN/Inf weight in the serving dtype; a weight
            file that changed while it was read; for a DoRA adapter, a missing, misshapen or non-finite
            magnitude, DoRA on an embedding or under tensor parallelism, a layer without a plain base
            weight, or a non-finite factor. Messages name the adapter, the file and the field or tensor.
    """
    if not dtype.is_floating_point:
        raise AdapterLoadError(f"adapter {name!r}: serving dtype must be floating point, got {dtype}")
    with open_adapter(
        name,
        path,
        allowed_roots=allowed_roots,
        allow_pickle=allow_pickle,
        max_file_bytes=max_file_bytes,
        max_tensors=max_tensors,
    ) as file:
        return load_opened(
            file,
            targets,
            max_rank=max_rank,
            dtype=dtype,
            pin_memory=pin_memory,
            shards=shards,
            base_weights=base_weights,
        )


def load_opened(
    file: AdapterFile,
    targets: LoRATargets,
    *,
    max_rank: int,
    dtype: torch.dtype,
    pin_memory: bool | None = None,
    shards: ShardPlan | None = None,
    base_weights: BaseWeights | None = None,
) -> HostAdapter:
    """:func:`load_adapter` of an adapter already opened (:func:`~lora_pin.weights.reader.open_adapter`,
    or :meth:`~lora_pin.weights.reader.AdapterFile.in_memory` for tensors handed over in memory): the same
    checks, the same errors, and its digest.

    Raises:
        AdapterLoadError: as :func:`load_adapter`.
    """
    name = file.name
    if not dtype.is_floating_point:
        raise AdapterLoadError(f"adapter {name!r}: serving dtype must be floating point, got {dtype}")
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    plans = _plans(targets)
    plan_key = (
        None if file.layout_key is None or shards is not None else (*file.layout_key, max_rank, dtype, pin)
    )
    plan = None if plan_key is None else plans.get(plan_key)
    if plan is not None:
        return plan.load(file, targets, dtype)
    ranks, pairs = _check_against_model(file, targets, max_rank, shards)
    touched = [g for g in targets.groups if any(m.key in ranks for m in g.members)]
    slab = _Slab(sum(_group_numel(g, ranks, shards) for g in touched), dtype, pin)
    reads: list[tuple[str, torch.Tensor]] = []
    built = [_build_module(file, g, ranks, pairs, slab, reads, shards) for g in touched]
    searched = list(zip(reads, file.read_many(reads), strict=True))
    modules = _host_modules(file, pairs, built, pin, shards)
    _refuse_non_finite(file, pairs, slab, modules.values(), searched, 2 * len(ranks))
    if file.config.use_dora and base_weights is not None:
        modules = _with_factors(file, modules, base_weights, shards)
    file.check_unchanged()
    digest = adapter_digest(file.digests.result(), _served(modules.values(), pairs))
    whole = sum(_whole_numel(g, ranks, shards) for g in touched) * slab.memory.element_size()
    whole += sum(_whole_dora_nbytes(m, shards) for m in modules.values())
    if plan_key is not None and not file.unused and not file.config.use_dora:
        plans.put(plan_key, _LoadPlan.of(file, pairs, slab, modules, reads, searched, whole))
    return HostAdapter(
        name, file.directory, file.config, targets, dtype, modules, 2 * len(ranks), digest, whole
    )


# One read of a plan: tensor name, stored dtype, shape, file offset, byte offset in the slab, bytes.
_PlannedRead = tuple[str, str, tuple[int, ...], int, int, int]
# One group of a plan: the group, A's and B's element offset in the slab and shape, per slice rank and
# scaling, and the rank and scaling tensors (the first load's: nothing writes them, the pool copies
# them, so every load by the plan shares them).
_PlannedModule = tuple[
    TargetGroup,
    int,
    tuple[int, int],
    int,
    tuple[int, int],
    tuple[int, ...],
    tuple[float, ...],
    torch.Tensor,
    torch.Tensor,
]


@dataclass(frozen=True)
class _LoadPlan:
    """What a load of one adapter decided from its config, its weight file's header and the model
    (every check passed, the slab's layout, what each tensor's bytes go where, the ranks and scalings,
    the modules its digest covers), kept so that a later load with the same config and header bytes
    (:attr:`~lora_pin.weights.reader.AdapterFile.layout_key`), for the same model, max rank, dtype and
    memory pinning, only reads and hashes the tensors: adapters trained alike share all of it, and
    deciding it again costs more than reading them.

    Only plain loads are kept: a safetensors file with no unused tensor (PEFT's copies of base weights
    are compared by value on every load), no DoRA magnitudes, no expert weights, unsharded, every tensor
    read straight into its place in the serving dtype and those places covering the whole slab (no
    padding to zero, and the core's NaN/Inf search covers every element).
    """

    numel: int
    pin: bool
    reads: tuple[_PlannedRead, ...]
    modules: tuple[_PlannedModule, ...]
    served: tuple[ServedModule, ...]
    tensors: int
    whole_nbytes: int

    @classmethod
    def of(
        cls,
        file: AdapterFile,
        pairs: dict[str, LoraTensorPair],
        slab: _Slab,
        modules: dict[str, HostModule],
        reads: list[tuple[str, torch.Tensor]],
        searched: list[tuple[tuple[str, torch.Tensor], int | None]],
        whole_nbytes: int,
    ) -> _LoadPlan | None:
        """The plan of a load that just succeeded (its slab, modules, reads and the core's NaN/Inf
        counts), or None when it is not a plain load (see the class)."""
        memory = slab.memory
        size, base = memory.element_size(), memory.data_ptr()
        if any(bad is None for _, bad in searched) or any(g.group.experts for g in modules.values()):
            return None
        planned = []
        for tensor_name, out in reads:
            dtype, shape, begin, end = file.stored(tensor_name)
            planned.append((tensor_name, dtype, shape, begin, out.data_ptr() - base, end - begin))
        if sum(r[5] for r in planned) != memory.nbytes:
            return None
        built = tuple(
            (
                m.group,
                (m.a.data_ptr() - base) // size,
                (m.a.shape[0], m.a.shape[1]),
                (m.b.data_ptr() - base) // size,
                (m.b.shape[0], m.b.shape[1]),
                m.ranks,
                m.scalings,
                m.rank_tensor,
                m.scaling_tensor,
            )
            for m in modules.values()
        )
        return cls(
            memory.numel(),
            memory.is_pinned(),
            tuple(planned),
            built,
            tuple(_served(modules.values(), pairs)),
            len(reads),
            whole_nbytes,
        )

    def load(self, file: AdapterFile, targets: LoRATargets, dtype: torch.dtype) -> HostAdapter:
        """:func:`load_opened` of ``file`` by this plan: one read of every tensor, then the views.

        Raises:
            AdapterLoadError: a tensor could not be read, holds a NaN/Inf, or the file changed.
        """
        memory = torch.empty(self.numel, dtype=dtype, pin_memory=self.pin)
        non_finite = file.read_at(self.reads, memory.data_ptr())
        size = memory.element_size()
        for (tensor_name, _, shape, _, at, nbytes), bad in zip(self.reads, non_finite, strict=True):
            if bad:
                copied = memory[at // size : (at + nbytes) // size].view(shape)
                raise _non_finite(file, tensor_name, copied, bad)
        file.check_unchanged()
        modules = {}
        for group, a_at, a_shape, b_at, b_shape, ranks, scalings, rank_tensor, scaling_tensor in self.modules:
            a = memory.as_strided(a_shape, (a_shape[1], 1), a_at)
            b = memory.as_strided(b_shape, (b_shape[1], 1), b_at)
            modules[group.key] = HostModule(group, a, b, ranks, scalings, rank_tensor, scaling_tensor)
        digest = adapter_digest(file.digests.result(), self.served)
        return HostAdapter(
            file.name,
            file.directory,
            file.config,
            targets,
            dtype,
            modules,
            self.tensors,
            digest,
            self.whole_nbytes,
        )


class _PlanCache:
    """The last few :class:`_LoadPlan` of one model's targets, by layout key and load settings."""

    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._held: dict[tuple[object, ...], _LoadPlan] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[object, ...]) -> _LoadPlan | None:
        with self._lock:
            found = self._held.pop(key, None)
            if found is not None:
                self._held[key] = found
            return found

    def put(self, key: tuple[object, ...], plan: _LoadPlan | None) -> None:
        if plan is None:
            return
        with self._lock:
            self._held[key] = plan
            while len(self._held) > self._entries:
                del self._held[next(iter(self._held))]


def _plans(targets: LoRATargets) -> _PlanCache:
    """``targets``' plan cache (held by the targets, so a plan never outlives the model it checked)."""
    cache = targets.__dict__.get("_load_plans")
    if cache is None:
        with _PLANS_LOCK:
            cache = targets.__dict__.get("_load_plans")
            if cache is None:
                cache = _PlanCache(_PLANS_PER_MODEL)
                object.__setattr__(targets, "_load_plans", cache)
    return cache


_PLANS_PER_MODEL = 32
_PLANS_LOCK = threading.Lock()


class HostTier:
    """The adapters held in host memory, by name; :meth:`load` adds one only if it loads completely.

    Which adapters stay is decided by the Rust core; this class only holds their tensors. ``max_file_bytes``
    and ``max_tensors`` are the per-adapter limits of :func:`load_adapter`; with ``shards`` (a
    tensor-parallel rank's plan) it reads and holds only this rank's part of each adapter. With
    ``base_weights`` (the model's, see :func:`load_adapter`) the DoRA adapters it reads get their factors.
    """

    def __init__(
        self,
        targets: LoRATargets,
        *,
        max_rank: int,
        dtype: torch.dtype,
        allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
        allow_pickle: bool = False,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_tensors: int = DEFAULT_MAX_TENSORS,
        shards: ShardPlan | None = None,
        base_weights: BaseWeights | None = None,
    ) -> None:
        self.targets = targets
        self.shards = shards
        self.base_weights = base_weights
        self.max_rank = max_rank
        self.dtype = dtype
        self.allowed_roots = None if allowed_roots is None else tuple(allowed_roots)
        self.allow_pickle = allow_pickle
        self.max_file_bytes = max_file_bytes
        self.max_tensors = max_tensors
        self._adapters: dict[str, HostAdapter] = {}

    def load(
        self, name: str, path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
    ) -> HostAdapter:
        """Load the adapter at ``path`` as ``name`` (:meth:`read`, then :meth:`add`); on failure nothing
        changes.

        Raises:
            DuplicateAdapterError: ``name`` is already held.
            AdapterLoadError: and its subclasses, as :func:`load_adapter`.
        """
        self._refuse_held(name)
        return self.add(self.read(name, path, root=root))

    def read(
        self, name: str, path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
    ) -> HostAdapter:
        """Read the adapter at ``path`` as ``name`` (see :func:`load_adapter`) without adding it.

        ``root``, if given, confines this adapter (its folder and every file read from it) to that one
        folder instead of the tier's ``allowed_roots``.

        Raises:
            AdapterLoadError: and its subclasses, as :func:`load_adapter`.
        """
        return load_adapter(
            name,
            path,
            self.targets,
            max_rank=self.max_rank,
            dtype=self.dtype,
            allowed_roots=self.allowed_roots if root is None else (root,),
            allow_pickle=self.allow_pickle,
            max_file_bytes=self.max_file_bytes,
            max_tensors=self.max_tensors,
            shards=self.shards,
            base_weights=self.base_weights,
        )

    def read_tensors(self, tensors: AdapterTensors) -> HostAdapter:
        """Read an adapter handed over in memory (:func:`~lora_pin.weights.tensors.adapter_tensors`) as
        :meth:`read` reads one from disk: the same checks and errors; with ``shards``, this rank's part.

        Raises:
            AdapterLoadError: as :func:`load_adapter`.
        """
        with tensors.open() as file:
            return load_opened(
                file,
                self.targets,
                max_rank=self.max_rank,
                dtype=self.dtype,
                shards=self.shards,
                base_weights=self.base_weights,
            )

    def add(self, adapter: HostAdapter) -> HostAdapter:
        """Hold ``adapter`` (from :meth:`read`) under its name.

        Raises:
            DuplicateAdapterError: an adapter of that name is already held.
        """
        self._refuse_held(adapter.name)
        self._adapters[adapter.name] = adapter
        return adapter

    def _refuse_held(self, name: str) -> None:
        if name in self._adapters:
            raise DuplicateAdapterError(
                f"adapter {name!r} is already in the host tier ({self._adapters[name].path})"
            )

    def drop(self, name: str) -> HostAdapter:
        """Remove and return adapter ``name``.

        Raises:
            AdapterNotFoundError: ``name`` is not held; the message lists what is.
        """
        try:
            return self._adapters.pop(name)
        except KeyError:
            raise AdapterNotFoundError(
                f"adapter {name!r} is not in the host tier (held: {_listing(self._adapters) or 'none'})"
            ) from None

    def __getitem__(self, name: str) -> HostAdapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise AdapterNotFoundError(
                f"adapter {name!r} is not in the host tier (held: {_listing(self._adapters) or 'none'})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)

    @property
    def nbytes(self) -> int:
        """Host bytes held by every adapter in the tier."""
        return sum(a.nbytes for a in self._adapters.values())
