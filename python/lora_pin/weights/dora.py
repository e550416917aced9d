"""DoRA (PEFT's ``use_dora=True``): the per-output-feature factor a DoRA adapter scales its layer by.

PEFT's eval-mode output of a DoRA linear (``peft/tuners/lora/dora.py``, ``DoraLinearLayer.forward``) is

    y = base(x) + (f - 1) * (base(x) - bias) + f * scaling * B A x,   f = m / ||W + scaling * B A||

with the norm taken over each output feature's row of the ``[out, in]`` weight and treated as a constant
(detached), ``m`` the adapter's ``lora_magnitude_vector`` ``[out]`` and dropout off. Equivalently
``y = f * (base(x) - bias + scaling * B A x) + bias``: the plain LoRA output, then each DoRA row rescaled
around the bias, which is how lora_pin serves it (:func:`lora_pin.ops.dora_scale_`). ``f`` depends only on
the adapter and the base weight, so it is computed once when the adapter is read (:func:`dora_factor`, on
the base weight's device, in float32) and kept in the host tier and in the device slot beside A and B.

Under tensor parallelism a column-parallel rank holds whole rows of ``W`` (its output features) and the
whole A, so its factors are its own. A row-parallel rank holds only its input columns of ``W`` and of A:
the squared norm of a row is the sum of the ranks' squared norms over their columns, so each rank's read
keeps its part (:attr:`~lora_pin.weights.hosted.HostModule.norm_sq`) and :func:`finish_factors` completes
them with an all-reduce once every rank's read is agreed (a collective inside a read could wait forever
for a rank whose read failed).

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
    from lora_pin.weights.hosted import HostAdapter, HostModule

__all__ = [
    "BaseWeights",
    "checked_factor",
    "dora_factor",
    "dora_norm_sq",
    "factor_from_norms",
    "factor_nbytes",
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

# Output rows of W converted to float32 at once: bounds the transient memory of a large layer.
_ROWS_PER_CHUNK = 1024


def module_slices(module: HostModule) -> list[tuple[int, int, int, float] | None]:
    """The :data:`Slices` of a host module: each targeted slice's output rows, rank and scaling."""
    offsets = module.group.slice_offsets
    return [
        (offsets[s], offsets[s + 1], rank, module.scalings[s]) if rank else None
        for s, rank in enumerate(module.ranks)
    ]


def dora_norm_sq(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slices: Slices) -> torch.Tensor:
    """The squared norms ``||W_i + s B_i A||^2`` of every output feature ``i`` of one layer group.

    Args:
        weight: the base weight ``[out, in]`` (any float dtype and device; the work runs on its device), or
            one rank's input columns of it (a row-parallel shard, with ``a`` the same columns of A).
        a: the group's A ``[n_slices * R, in]``; b: its B ``[out, R]`` (the host tier's layout).
        slices: as :data:`Slices`.

    Returns:
        float32 ``[out]`` on the CPU: the squared norm over ``weight``'s columns on DoRA slices' rows, 0
        elsewhere. Over the input shards of a row-parallel layer these parts sum to the whole norm.
    """
    device = weight.device
    out = weight.shape[0]
    norm_sq = torch.zeros(out, dtype=torch.float32, device=device)
    max_rank = a.shape[0] // max(len(slices), 1)
    for s, spec in enumerate(slices):
        if spec is None:
            continue
        first, last, rank, scaling = spec
        a_s = a[s * max_rank : s * max_rank + rank].to(device=device, dtype=torch.float32)  # [r, in]
        gram = a_s @ a_s.T  # [r, r]
        for row in range(first, last, _ROWS_PER_CHUNK):
            end = min(row + _ROWS_PER_CHUNK, last)
            # ||W_i + s B_i A||^2 = ||W_i||^2 + 2 s B_i (W_i Aᵀ) + s^2 B_i (A Aᵀ) B_iᵀ: two reads of W and
            # [rows, r] temporaries, instead of materialising W + s B A ([rows, in]) and squaring it.
            w = weight[row:end].to(torch.float32)
            b_rows = b[row:end, :rank].to(device=device, dtype=torch.float32)
            cross = (b_rows * (w @ a_s.T)).sum(dim=1)
            own = ((b_rows @ gram) * b_rows).sum(dim=1)
            base = torch.linalg.vector_norm(w, dim=1).square()
            norm_sq[row:end] = base + (2 * scaling) * cross + (scaling * scaling) * own
    return norm_sq.cpu()


def factor_from_norms(norm_sq: torch.Tensor, magnitude: torch.Tensor, slices: Slices) -> torch.Tensor:
    """``m / sqrt(norm_sq)`` on the DoRA slices' rows, 1 elsewhere: float32 ``[out]`` on the CPU.

    Args:
        norm_sq: float32 ``[out]``, whole squared norms (:func:`dora_norm_sq`, summed over the ranks).
        magnitude: float32 ``[out]``, the adapter's magnitudes (read only on the DoRA slices' rows).
        slices: as :data:`Slices`.

    A row whose norm is zero gets inf or NaN (the caller refuses it: :func:`checked_factor`).
    """
    factor = torch.ones(norm_sq.shape[0], dtype=torch.float32)
    # Rounding can leave a zero norm's square a hair below zero: it is zero (and refused by the caller).
    norms = norm_sq.clamp_min(0).sqrt().cpu()
    for spec in slices:
        if spec is not None:
            first, last = spec[0], spec[1]
            factor[first:last] = magnitude[first:last] / norms[first:last]
    return factor


def dora_factor(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slices: Slices, magnitude: torch.Tensor
) -> torch.Tensor:
    """The DoRA factor ``m / ||W + s * B A||`` per output feature of one layer group, float32 ``[out]``
    on the CPU (:func:`dora_norm_sq` of the whole ``weight``, then :func:`factor_from_norms`)."""
    return factor_from_norms(dora_norm_sq(weight, a, b, slices), magnitude, slices)


def checked_factor(where: str, key: str, factor: torch.Tensor) -> torch.Tensor:
    """``factor`` when every entry is finite.

    Raises:
        AdapterLoadError: naming ``where`` (the adapter), module ``key`` and the first output feature whose
            factor is not finite (a row of ``W + s B A`` of norm zero, or a magnitude too large for float32).
    """
    if not bool(torch.isfinite(factor).all()):
        row = int((~torch.isfinite(factor)).nonzero()[0])
        raise AdapterLoadError(
            f"{where}: module {key!r}: the DoRA factor m / ||W + s B A|| of output feature {row} is "
            f"{float(factor[row])} (the norm is zero, or the magnitude is out of float32's range); "
            "refused"
        )
    return factor


def finish_factors(adapter: HostAdapter, reduce: Callable[[torch.Tensor], None]) -> HostAdapter:
    """``adapter`` with the factors of its row-parallel DoRA modules computed from every rank's part of
    their squared norms; ``adapter`` itself when it has none pending (plain LoRA, one process, column
    layers).

    Args:
        reduce: sums a float32 ``[n]`` tensor over the tensor-parallel ranks in place (an all-reduce):
            called once, with every pending module's norms, and only when some are pending, which is
            alike on every rank that read the same adapter (the modules pending are its row-parallel
            DoRA groups). Every rank must then call this for the same adapters in the same order.

    Raises:
        AdapterLoadError: a factor is not finite (:func:`checked_factor`); alike on every rank, since each
            holds the whole norms and magnitudes of a row-parallel layer.
    """
    pending = {k: m for k, m in adapter.modules.items() if m.norm_sq is not None}
    if not pending:
        return adapter
    norms = torch.cat([m.norm_sq for m in pending.values() if m.norm_sq is not None])
    reduce(norms)
    where = f"adapter {adapter.name!r} ({adapter.path})"
    done = dict(adapter.modules)
    for (key, module), norm_sq in zip(
        pending.items(), norms.split([m.b.shape[0] for m in pending.values()]), strict=True
    ):
        assert module.magnitude is not None
        factor = factor_from_norms(norm_sq, module.magnitude, module_slices(module))
        checked_factor(where, key, factor)
        pinned = module.a.is_pinned()
        done[key] = replace(module, factor=factor.pin_memory() if pinned else factor, norm_sq=None)
    return replace(adapter, modules=done)


def factor_nbytes(out_features: int, dtype: torch.dtype) -> int:
    """Bytes of one group's factor in a device slot (``[out]`` in the pool's dtype)."""
    return out_features * torch.empty((), dtype=dtype).element_size()
