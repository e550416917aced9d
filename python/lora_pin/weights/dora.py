"""DoRA (PEFT's ``use_dora=True``): the per-output-feature factor a DoRA adapter scales its layer by.

PEFT's eval-mode output of a DoRA linear (``peft/tuners/lora/dora.py``, ``DoraLinearLayer.forward``) is

    y = base(x) + (f - 1) * (base(x) - bias) + f * scaling * B A x,   f = m / ||W + scaling * B A||

with the norm taken over each output feature's row of the ``[out, in]`` weight and treated as a constant
(detached), ``m`` the adapter's ``lora_magnitude_vector`` ``[out]`` and dropout off. Equivalently
``y = f * (base(x) - bias + scaling * B A x) + bias``: the plain LoRA output, then each DoRA row rescaled
around the bias, which is how lora_pin serves it (:func:`lora_pin.ops.dora_scale_`). ``f`` depends only on
the adapter and the base weight, so it is computed once when the adapter is read, on the base weight's
device (:func:`dora_norm_parts`: the rows of ``W + s B A`` formed in float64, so a row that is tiny
against ``W`` keeps its digits; :func:`checked_factor` refuses a row whose norm is zero), and kept in the
host tier and in the device slot beside A and B.

Under tensor parallelism a column-parallel rank holds whole rows of ``W`` (its output features) and the
whole A, so its factors are its own. A row-parallel rank holds only its input columns of ``W`` and of A:
the squared norm of a row is the sum of the ranks' squared norms over their columns, so each rank's read
keeps its part (:attr:`~lora_pin.weights.host_adapter.HostModule.norm_parts`) and :func:`finish_factors`
completes them with an all-reduce once every rank's read is agreed (a collective inside a read could wait
forever for a rank whose read failed).

Only linear layers: PEFT's DoRA on embeddings and convolutions scales differently, and lora_pin serves
neither (they are refused by name, as MoE expert weights are).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from lora_pin.errors import AdapterLoadError

if TYPE_CHECKING:
    from lora_pin.weights.host_adapter import HostAdapter, HostModule
    from lora_pin.weights.targets import TargetGroup

__all__ = [
    "BaseWeights",
    "checked_factor",
    "dora_norm_parts",
    "finish_factors",
    "module_slices",
]

#: Group key (``model.layers.0.self_attn.q_proj``) -> a function returning the base weight that computes
#: the group, as ``[out_total, in]`` (a fused layer's slices stacked along the output), on the model's
#: device, or None when the layer keeps no such weight.
BaseWeights = Mapping[str, Callable[[], "torch.Tensor | None"]]

#: Per slice of a group, ``(first_row, last_row, rank, scaling)`` of its output rows, or None for a slice
#: the adapter has no DoRA on.
Slices = Sequence[tuple[int, int, int, float] | None]

# Elements of W + s B A formed at once, in float64. On the CPU 1 MiB, which stays in cache from the copy of
# W through the product to the norm (a 4096 x 4096 layer took twice as long in 8 MiB blocks); on a device
# 32 MiB: fewer launches, for a transient small beside the model.
_CPU_BLOCK = 1 << 17
_DEVICE_BLOCK = 1 << 22


def module_slices(module: HostModule) -> list[tuple[int, int, int, float] | None]:
    """The :data:`Slices` of a host module: each targeted slice's output rows, rank and scaling."""
    offsets = module.group.slice_offsets
    return [
        (offsets[s], offsets[s + 1], rank, module.scalings[s]) if rank else None
        for s, rank in enumerate(module.ranks)
    ]


def dora_norm_parts(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slices: Slices) -> torch.Tensor:
    """The squared norms ``||W_i + s B_i A||^2`` of every output feature ``i`` of one layer group, and
    the square of the largest norm that rounding alone could give a row that is exactly zero.

    PEFT's norm (``DoraLinearLayer.get_weight_norm``) is ``torch.linalg.norm(W + s * B A, dim=1)``, in the
    adapter's dtype (float32 unless PEFT was told otherwise), with ``W`` cast to it. Here the rows of
    ``W + s B A`` are formed in float64, a block of rows at a time, from ``W`` as the model holds it and A
    and B as the host tier holds them (the values the layers serve, so a served row's output stays within
    its magnitude), then reduced. Each norm's error is then at most about ``(r + 2) 2^-53 (||W_i|| + |s|
    sum_k |B_ik| ||A_k||)``: relative to the norm itself, a row at 1e-6 of ``||W_i||`` keeps about eight
    digits, where expanding the square (``||W_i||^2 + 2 s <W_i, B_i A> + s^2 ||B_i A||^2``) in float32
    kept none, and where PEFT's float32 sum keeps about one.

    Args:
        weight: the base weight ``[out, in]`` (any float dtype and device; the work runs on its device), or
            one rank's input columns of it (a row-parallel shard, with ``a`` the same columns of A).
        a: the group's A ``[n_slices * R, in]``; b: its B ``[out, R]`` (the host tier's layout).
        slices: as :data:`Slices`.

    Returns:
        float64 ``[2, out]`` on the CPU: row 0 the squared norms over ``weight``'s columns, row 1 the
        squared bound ``((r + 4) 2^-51 |s| sum_k |B_ik| ||A_k||)^2`` (over twice the error above on a row
        where ``|W_ij| <= |s| sum_k |B_ik A_kj|``, as in one that cancels exactly); 0 on the rows of slices
        without DoRA. Over the input shards of a row-parallel layer both rows sum to the whole rows' (squares
        over disjoint columns add up). :func:`checked_factor` makes the factors of them.
    """
    device = weight.device
    out, width = weight.shape
    parts = torch.zeros(2, out, dtype=torch.float64, device=device)
    max_rank = a.shape[0] // max(len(slices), 1)
    per_block = _CPU_BLOCK if device.type == "cpu" else _DEVICE_BLOCK
    rows_per_block = max(1, per_block // max(width, 1))
    block = torch.empty(min(rows_per_block, out), width, dtype=torch.float64, device=device)
    for s, spec in enumerate(slices):
        if spec is None:
            continue
        first, last, rank, scaling = spec
        a_s = a[s * max_rank : s * max_rank + rank].to(device=device, dtype=torch.float64)  # [r, in]
        b_s = b[first:last, :rank].to(device=device, dtype=torch.float64)  # [rows, r]
        reach = torch.linalg.vector_norm(a_s, dim=1) * (abs(scaling) * (rank + 4) * 2.0**-51)  # [r]
        parts[1, first:last] = (b_s.abs() @ reach).square()
        for row in range(first, last, rows_per_block):
            end = min(row + rows_per_block, last)
            formed = block[: end - row].copy_(weight[row:end])
            formed.addmm_(b_s[row - first : end - first], a_s, alpha=scaling)  # W + s B A, [rows, in]
            parts[0, row:end] = torch.linalg.vector_norm(formed, dim=1).square()
    return parts.cpu()


def checked_factor(
    where: str,
    group: TargetGroup,
    parts: torch.Tensor,
    magnitude: torch.Tensor,
    slices: Slices,
    dtype: torch.dtype,
    first_features: Sequence[int] | None = None,
) -> torch.Tensor:
    """The DoRA factor ``m / ||W + s B A||`` per output feature of one layer group, float32 ``[out]`` on
    the CPU (1 on the rows of slices without DoRA), when every DoRA row's is servable.

    Args:
        where: the adapter, for messages.
        group: the layer group (its members name the modules in messages).
        parts: float64 ``[2, out]``, :func:`dora_norm_parts` of the whole rows (summed over the ranks of a
            row-parallel layer).
        magnitude: float32 ``[out]``, the adapter's magnitudes (read only on the DoRA slices' rows).
        slices: as :data:`Slices`.
        dtype: the serving dtype, in which the device slot holds the factor.
        first_features: per slice, the output feature of its whole module that its first row is (a
            column-parallel rank holds a shard); 0 for every slice by default.

    Raises:
        AdapterLoadError: naming ``where``, the module and the output feature, when a row's norm is zero
            (at most the rounding bound of :func:`dora_norm_parts`: the base weight's row is ``-s B A``'s,
            and PEFT would divide by zero), or a factor is out of ``dtype``'s range.
    """
    norms, bounds = parts[0].sqrt(), parts[1].sqrt()
    factor = torch.ones(parts.shape[1], dtype=torch.float32)
    for s, spec in enumerate(slices):
        if spec is None:
            continue
        first, last = spec[0], spec[1]
        offset = (0 if first_features is None else first_features[s]) - first
        named = f"{where}: module {group.members[s].key!r}: output feature"
        if bool((zero := norms[first:last] <= bounds[first:last]).any()):
            row = first + int(zero.nonzero()[0])
            raise AdapterLoadError(
                f"{named} {row + offset}: the norm ||W + s B A|| is zero (the base weight's row is -s B A's, "
                f"to float64 rounding: {float(norms[row]):.3g} <= {float(bounds[row]):.3g}); PEFT would "
                "divide by it; refused"
            )
        factor[first:last] = (magnitude[first:last].double() / norms[first:last]).float()
        if not bool((servable := torch.isfinite(factor[first:last].to(dtype))).all()):
            row = first + int((~servable).nonzero()[0])
            raise AdapterLoadError(
                f"{named} {row + offset}: the DoRA factor m / ||W + s B A|| = {float(magnitude[row])} / "
                f"{float(norms[row]):.6g} is out of {dtype}'s range; refused"
            )
    return factor


def finish_factors(adapter: HostAdapter, reduce: Callable[[torch.Tensor], None]) -> HostAdapter:
    """``adapter`` with the factors of its row-parallel DoRA modules computed from every rank's part of
    their norms; ``adapter`` itself when it has none pending (plain LoRA, one process, column layers).

    Args:
        reduce: sums a float64 ``[2, n]`` tensor over the tensor-parallel ranks in place (an all-reduce):
            called once, with every pending module's :func:`dora_norm_parts` side by side, and only when
            some are pending, which is alike on every rank that read the same adapter (the modules pending
            are its row-parallel DoRA groups). Every rank must then call this for the same adapters in the
            same order.

    Raises:
        AdapterLoadError: a norm is zero or a factor out of range (:func:`checked_factor`); alike on every
            rank, since each holds the whole norms and magnitudes of a row-parallel layer.
    """
    pending = {k: m for k, m in adapter.modules.items() if m.norm_parts is not None}
    if not pending:
        return adapter
    parts = torch.cat([m.norm_parts for m in pending.values() if m.norm_parts is not None], dim=1)
    reduce(parts)
    where = f"adapter {adapter.name!r} ({adapter.path})"
    done = dict(adapter.modules)
    for (key, module), module_parts in zip(
        pending.items(), parts.split([m.b.shape[0] for m in pending.values()], dim=1), strict=True
    ):
        assert module.magnitude is not None
        slices = module_slices(module)
        # A row-parallel rank holds every output row (DoRA is refused when fully sharded).
        factor = checked_factor(where, module.group, module_parts, module.magnitude, slices, adapter.dtype)
        pinned = module.a.is_pinned()
        done[key] = replace(module, factor=factor.pin_memory() if pinned else factor, norm_parts=None)
    return replace(adapter, modules=done)
