"""DoRA rows' rescale: the ``lora_pin::dora_scale_`` custom op and its fp64 reference.

A DoRA adapter's layer output is the plain LoRA output rescaled per output feature around the bias:
``out = f * (base + delta - bias) + bias`` (:mod:`lora_pin.weights.dora`). So a DoRA row runs the same
shrink and expand as a LoRA row, then this op, on the rows whose slot holds a DoRA adapter in the layer
group; every other row (base, plain LoRA) is left bit for bit as it was.

CUDA tensors run a Triton kernel (:mod:`lora_pin.ops.triton_dora`; it reads shapes only on the host, so a
CUDA graph can capture it); float32 CPU tensors one native call (``lora_pin._core.dora_scale_rows``, each row
read and written once in place: torch's gather, arithmetic and scatter cost five dispatches, most of a
decode step's DoRA work); every other case gathers in torch. All compute in float32 and round once into
``out``'s dtype.
"""

from __future__ import annotations

import torch

from lora_pin._core import dora_scale_rows
from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import check_dora_args

__all__ = ["dora_scale_", "dora_scale_reference", "scale_rows_", "scale_rows_torch_"]


def _check_contents(
    out: torch.Tensor, factors: torch.Tensor, rows: torch.Tensor, row_slots: torch.Tensor
) -> None:
    """The indices are in range (CPU only: the CUDA path never reads tensor contents on the host)."""
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= out.shape[0]:
        raise OpArgumentError(f"dora_scale_: rows must lie in [0, {out.shape[0]}), got {rows.tolist()[:8]}")
    if int(row_slots.min()) < -1 or int(row_slots.max()) >= factors.shape[0]:
        raise OpArgumentError(
            f"dora_scale_: row_slots must lie in [-1, {factors.shape[0]}), got {row_slots.tolist()[:8]}"
        )


def dora_scale_torch(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    check_dora_args(out, bias, factors, dora, rows, row_slots)
    slots = row_slots.long()
    _check_contents(out, factors, rows, row_slots)
    keep = (slots >= 0) & (dora.index_select(0, slots.clamp_min(0)) != 0)
    if not bool(keep.all()):
        rows, slots = rows[keep], slots[keep]
    if rows.numel() == 0:
        return
    scale_rows_(out, bias, factors, rows, slots)


def scale_rows_(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """The arithmetic of :func:`dora_scale_` on rows already known to be DoRA rows, with no check: what
    the layers call in eager mode on the CPU for the step's prepared rows (int64 ``rows`` and ``slots``,
    ``[N]``, made from the step's own arrays; torch bounds-checks the indices), skipping the dispatcher,
    whose cost at decode sizes is that of the arithmetic itself."""
    if _native(out, bias, factors, rows, slots):
        dora_scale_rows(
            (out.data_ptr(), out.numel()),
            out.shape[1],
            None if bias is None else (bias.data_ptr(), bias.numel()),
            (factors.data_ptr(), factors.numel()),
            (rows.data_ptr(), rows.numel()),
            (slots.data_ptr(), slots.numel()),
        )
        return
    scale_rows_torch_(out, bias, factors, rows, slots)


def scale_rows_torch_(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """:func:`scale_rows_` in torch (gather, rescale, scatter): any dtype, layout and device."""
    # float32 throughout (no copies for a float32 out), rounded once into out's dtype.
    picked = out.index_select(0, rows).float()
    scale = factors.index_select(0, slots).float()
    if bias is None:
        picked.mul_(scale)
    else:
        shift = bias.float()
        torch.addcmul(shift, picked.sub_(shift), scale, out=picked)
    # index_put_ rather than index_copy_: the same for distinct rows, and about 1.6x faster for [32, 4096]
    # fp32 on the CPU (87 against 137 µs).
    out.index_put_((rows,), picked.to(out.dtype))


def _native(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
) -> bool:
    """Whether :func:`scale_rows_` can hand its tensors to the native rescale: contiguous float32 on the
    CPU, int64 indices (what it borrows by address)."""
    # A layer calls this for every step's DoRA rows: the cheapest tests (is_cpu, not device.type) first.
    f32, i64 = torch.float32, torch.int64
    return (
        out.dtype is f32
        and factors.dtype is f32
        and rows.dtype is i64
        and slots.dtype is i64
        and out.is_cpu
        and factors.is_cpu
        and rows.is_cpu
        and slots.is_cpu
        and out.is_contiguous()
        and factors.is_contiguous()
        and rows.is_contiguous()
        and slots.is_contiguous()
        and (bias is None or (bias.dtype is f32 and bias.is_cpu and bias.is_contiguous()))
    )


def dora_scale_cuda(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    from lora_pin.ops.triton_dora import dora_scale_triton

    dora_scale_triton(out, bias, factors, dora, rows, row_slots, interpret=False)


def dora_scale_fake(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    check_dora_args(out, bias, factors, dora, rows, row_slots)


def dora_scale_(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
) -> torch.Tensor:
    """Rescale the DoRA rows of a layer output in place: ``out[r] = f[slot] * (out[r] - bias) + bias``.

    Run it after the LoRA delta was added (:func:`lora_pin.ops.expand`); only rows ``rows[i]`` whose
    ``row_slots[i]`` is not -1 and has ``dora[slot] != 0`` change; every other row of ``out`` is left
    bit for bit. Computed in float32, rounded once into ``out``'s dtype.

    Args:
        out: ``[T, O]`` fp16/bf16/fp32, the layer output (base plus LoRA delta), mutated.
        bias: ``[O]`` in ``out``'s dtype, the bias the base layer added to ``out``, or None.
        factors: ``[slots, O]`` in ``out``'s dtype, each slot's DoRA factor per output feature.
        dora: int32 ``[slots]``, nonzero where the slot holds a DoRA adapter in this layer group.
        rows: int64 ``[N]``, row indices into ``out`` (each at most once).
        row_slots: int32 ``[N]``, the slot of each row (-1: no adapter).

    Returns:
        ``out``.

    Raises:
        OpArgumentError: a shape, dtype or device mismatch; on CPU also an index out of range; or
            ``out`` requires grad with grad mode on (the op has no autograd formula).
    """
    if torch.is_grad_enabled() and out.requires_grad:
        raise OpArgumentError(
            "lora_pin ops have no autograd formula; run them under torch.inference_mode() or torch.no_grad()"
        )
    torch.ops.lora_pin.dora_scale_(out, bias, factors, dora, rows, row_slots)
    return out


def dora_scale_reference(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
) -> torch.Tensor:
    """:func:`dora_scale_` in float64, row by row, returning a new float64 ``[T, O]`` tensor (for tests)."""
    result = out.detach().double().cpu().clone()
    shift = torch.zeros(out.shape[1], dtype=torch.float64) if bias is None else bias.double().cpu()
    for row, slot in zip(rows.tolist(), row_slots.tolist(), strict=True):
        if slot >= 0 and int(dora[slot]) != 0:
            factor = factors[slot].double().cpu()
            result[row] = factor * (result[row] - shift) + shift
    return result
