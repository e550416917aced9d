"""The building of an adapter's host modules once it passed the checks against the model: the slab's views
for each group's A and B, the tensors read into them (on a tensor-parallel rank, its part of each), a DoRA
adapter's magnitudes and factors, and the modules its digest covers.

Weights that are NaN or infinite after conversion to the serving dtype (also finite values that overflow it,
e.g. 1e5 in float16) are refused, not warned about: one such value turns every output of every request
using the adapter into NaN, and nothing downstream could tell a user why.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from lora_pin.errors import AdapterLoadError
from lora_pin.weights.digest import ServedModule
from lora_pin.weights.dora import BaseWeights, checked_factor, dora_norm_parts, module_slices
from lora_pin.weights.host_adapter import HostModule, _Slab
from lora_pin.weights.reader import AdapterFile, LoraTensorPair
from lora_pin.weights.shards import GroupCut, ShardPlan
from lora_pin.weights.targets import TargetGroup


def _group_ranks(group: TargetGroup, ranks: dict[str, int]) -> tuple[int, ...]:
    if group.experts:
        return (ranks.get(group.members[0].key, 0),) * group.experts
    return tuple(ranks.get(m.key, 0) for m in group.members)


def _group_numel(group: TargetGroup, ranks: dict[str, int], shards: ShardPlan[GroupCut]) -> int:
    a_rank, b_out, b_rank = shards.host_shape(group, max(_group_ranks(group, ranks)))
    return a_rank * group.n_slices * group.in_features + b_out * b_rank


def _whole_numel(group: TargetGroup, ranks: dict[str, int], shards: ShardPlan[GroupCut]) -> int:
    """The elements of ``group``'s host module on an unsharded model: :func:`_group_numel` from the
    layers' unsharded widths (alike on every tensor-parallel rank)."""
    rank = max(_group_ranks(group, ranks))
    full_in, full_out = shards.whole_widths(group)
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
    shards: ShardPlan[GroupCut],
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
    a_rank, b_out, b_rank = shards.host_shape(group, rank)
    padded = shards.cuts_rank(group) or any(r != rank for r in slice_ranks)
    a = slab.take((group.n_slices * a_rank, group.in_features), padded)
    b = slab.take((b_out, b_rank), padded)
    offsets = shards.b_offsets(group)
    if group.experts:
        _read_experts(file, pairs[group.key], group.experts, a, b, group.members[0].peft_swapped)
    for s, member in enumerate(() if group.experts else group.members):
        if not slice_ranks[s]:
            continue
        pair = pairs[member.key]
        b_cols = b[offsets[s] : offsets[s + 1], : slice_ranks[s]]
        shard = shards.member(member)
        if shard.is_whole:
            reads.append((pair.a_name, a[s * a_rank : s * a_rank + slice_ranks[s]]))
            reads.append((pair.b_name, b_cols))
            continue
        # This rank's part only: A's columns of its input shard (and its chunk of the rank's rows when
        # fully sharded), B's rows of its output shard.
        chunk = shards.rank_chunk if shard.cut_rank else 0
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
    shards: ShardPlan[GroupCut],
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
    shards: ShardPlan[GroupCut],
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
        first, last = shards.member(member).b_rows
        rows = stored[first:last]
        magnitude[offsets[s] : offsets[s + 1]] = rows.to(torch.float32)
    return magnitude


def _with_factors(
    file: AdapterFile,
    modules: dict[str, HostModule],
    base_weights: BaseWeights,
    shards: ShardPlan[GroupCut],
) -> dict[str, HostModule]:
    """The DoRA ``modules`` with their factors computed against the model's ``base_weights``; with
    ``shards``, a row-parallel group's with this rank's part of its norms instead (see :class:`HostModule`).

    Raises:
        AdapterLoadError: a module's base weight cannot be read (its layer keeps no plain ``[out, in]``
            weight) or has another shape, or a row of ``W + s B A`` has norm zero, or a factor is out of
            the serving dtype's range (:func:`~lora_pin.weights.dora.checked_factor`).
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
        with torch.no_grad():
            parts = dora_norm_parts(weight.detach(), module.a, module.b, slices)
        if shards.inputs_cut(key):
            done[key] = replace(module, norm_parts=parts)
            continue
        # A column-parallel rank's rows of a slice start at its shard of the module's output features.
        firsts = [shards.member(m).b_rows[0] for m in group.members]
        factor = checked_factor(where, group, parts, module.magnitude, slices, module.a.dtype, firsts)
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
