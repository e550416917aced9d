"""DoRA (PEFT's ``use_dora=True``): the per-output-feature factor a DoRA adapter scales its layer by.

PEFT's eval-mode output of a DoRA linear (``peft/tuners/lora/dora.py``, ``DoraLinearLayer.forward``) is

    y = base(x) + (f - 1) * (base(x) - bias) + f * scaling * B A x,   f = m / ||W + scaling * B A||

with the norm taken over each output feature's row of the ``[out, in]`` weight and treated as a constant
(detached), ``m`` the adapter's ``lora_magnitude_vector`` ``[out]`` and dropout off. Equivalently
``y = f * (base(x) - bias + scaling * B A x) + bias``: the plain LoRA output, then each DoRA row rescaled
around the bias, which is how lora_pin serves it (:func:`lora_pin.ops.dora_scale_`). ``f`` depends only on
the adapter and the base weight, so it is computed once when the adapter is read (:func:`dora_factor`, on
the base weight's device, in float32) and kept in the host tier and in the device slot beside A and B.

Only linear layers: PEFT's DoRA on embeddings and convolutions scales differently, and lora_pin serves
neither (they are refused by name, as MoE expert weights are).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["BaseWeights", "dora_factor", "factor_nbytes"]

#: Group key (``model.layers.0.self_attn.q_proj``) -> a function returning the base weight that computes
#: the group, as ``[out_total, in]`` (a fused layer's slices stacked along the output), on the model's
#: device, or None when the layer keeps no such weight.
BaseWeights = Mapping[str, Callable[[], "torch.Tensor | None"]]

# Output rows of W converted to float32 at once: bounds the transient memory of a large layer.
_ROWS_PER_CHUNK = 1024


def dora_factor(
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slices: Sequence[tuple[int, int, int, float] | None],
    magnitude: torch.Tensor,
    norm_sq_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The DoRA factor ``m / ||W + s * B A||`` per output feature of one layer group, float32 ``[out]``.

    Args:
        weight: the base weight ``[out, in]`` (any float dtype and device; the work runs on its device).
        a: the group's A ``[n_slices * R, in]``; b: its B ``[out, R]`` (the host tier's layout).
        slices: per slice, ``(first_row, last_row, rank, scaling)`` of its output rows and rank, or None
            for a slice the adapter has no DoRA on (its factor is 1).
        magnitude: float32 ``[out]``, the adapter's magnitudes (read only on the DoRA slices' rows).
        norm_sq_reduce: completes the squared norms ``[out]`` (float32) when ``weight`` is one input shard
            of a row-parallel layer (an all-reduce over the tensor-parallel ranks); None otherwise.

    Returns:
        float32 ``[out]`` on the CPU: the factor on DoRA slices' rows, 1 elsewhere; a row whose norm is
        zero gets inf or NaN (the caller refuses it).
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
    if norm_sq_reduce is not None:
        norm_sq = norm_sq_reduce(norm_sq)
    factor = torch.ones(out, dtype=torch.float32)
    # Rounding can leave a zero norm's square a hair below zero: it is zero (and refused by the caller).
    norms = norm_sq.clamp_min(0).sqrt().cpu()
    for spec in slices:
        if spec is not None:
            first, last = spec[0], spec[1]
            factor[first:last] = magnitude[first:last] / norms[first:last]
    return factor


def factor_nbytes(out_features: int, dtype: torch.dtype) -> int:
    """Bytes of one group's factor in a device slot (``[out]`` in the pool's dtype)."""
    return out_features * torch.empty((), dtype=dtype).element_size()
