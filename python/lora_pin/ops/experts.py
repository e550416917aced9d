"""LoRA on MoE experts: every routed (token, expert) row gets its adapter's delta for that expert.

After routing, a MoE layer computes each token's top-k experts; lora_pin's expert LoRA adds
``scaling * B[slot, e] (A[slot, e] x)`` to every row ``x`` of a token routed to expert ``e`` whose request
uses an adapter in ``slot``. The rows are grouped by ``(slot, expert)``: :func:`expert_segments` sorts them
by the flat index ``slot * E + e``, which turns the problem into the ordinary multi-adapter one over
``slots * E`` "slots", each one expert of one adapter. The pool stores an experts group as ``E`` slices of
one rank each (A ``[slots, E * R, in]``, B ``[slots, E * out, R]``, ranks and scalings ``[slots, E]``),
which is exactly the memory of ``slots * E`` one-slice slots: :func:`flat_expert_buffers` reshapes them
without a copy, and the ``lora_pin::shrink`` / ``lora_pin::expand`` custom ops (grouped torch GEMMs on
CPU, the Triton SGMV kernels on CUDA) run unchanged on the result. One step's segments serve both the
``gate_up_proj`` and the ``down_proj`` LoRA of a layer, since both see the same rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops.custom_ops import expand, shrink
from lora_pin.ops.segments import KernelMeta, segments_from_slots

__all__ = [
    "ExpertMeta",
    "expert_lora_delta_",
    "expert_reference",
    "expert_segments",
    "flat_expert_buffers",
]


def expert_segments(
    row_slots: torch.Tensor, row_experts: torch.Tensor, num_experts: int, chunk_size: int | None = None
) -> KernelMeta:
    """The segments of one MoE layer's routed rows, grouped by ``(slot, expert)``.

    Args:
        row_slots: integer ``[R]``, the device slot of each row's request, ``-1`` for no adapter.
        row_experts: integer ``[R]``, the expert each row is routed to; a value outside
            ``[0, num_experts)`` (the sentinel an expert-parallel rank gives experts it does not hold)
            gets no delta.
        num_experts: ``E``.
        chunk_size: the longest segment, as :func:`segments_from_slots` takes it.

    Returns:
        A :class:`KernelMeta` over the ``R`` rows whose ``seg_slots`` are flat indices
        ``slot * E + expert`` (see :func:`flat_expert_buffers`). Its shapes depend on the data.

    Raises:
        OpArgumentError: the two row tensors are not 1-D integer tensors of one length, or ``num_experts``
            is not positive.
    """
    for name, t in (("row_slots", row_slots), ("row_experts", row_experts)):
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise OpArgumentError(f"{name} must be a 1-D integer tensor, got {tuple(t.shape)} {t.dtype}")
    if row_slots.shape != row_experts.shape:
        raise OpArgumentError(
            f"row_slots {tuple(row_slots.shape)} and row_experts {tuple(row_experts.shape)} differ in length"
        )
    if num_experts <= 0:
        raise OpArgumentError(f"num_experts must be positive, got {num_experts}")
    slots, experts = row_slots.long(), row_experts.long()
    served = (slots >= 0) & (experts >= 0) & (experts < num_experts)
    flat = torch.where(served, slots * num_experts + experts, torch.full_like(slots, -1))
    return segments_from_slots(flat, chunk_size)


class ExpertMeta(NamedTuple):
    """One experts group's view of a step's routed rows: the :class:`KernelMeta` the ops take, over the
    flat ``slot * E + expert`` index, and ``E``.

    Build it with :meth:`for_group`; :func:`flat_expert_buffers` gives the A and B it indexes.
    """

    kernel: KernelMeta
    num_experts: int

    @classmethod
    def for_group(
        cls, segments: KernelMeta, slot_ranks: torch.Tensor, slot_scalings: torch.Tensor, out_features: int
    ) -> ExpertMeta:
        """The meta of ``segments`` (from :func:`expert_segments`) in an experts group whose pool holds
        ``slot_ranks`` (int32 ``[slots, E]``) and ``slot_scalings`` (float32 ``[slots, E]``), each expert's
        output ``out_features`` wide. Nothing is copied: the flat ranks and scalings are views."""
        num_experts = slot_ranks.shape[1]
        perm, seg_indptr, seg_slots = segments[:3]
        kernel = KernelMeta(
            perm,
            seg_indptr,
            seg_slots,
            slot_ranks.reshape(-1, 1),
            1,
            slot_scalings.reshape(-1, 1),
            (0, out_features),
        )
        return cls(kernel, num_experts)


def flat_expert_buffers(
    a: torch.Tensor, b: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An experts group's pool buffers as ``slots * E`` one-slice slots, without a copy.

    Args:
        a: ``[slots, E * R, in]``, expert e's A in rows ``[e * R, e * R + rank)``.
        b: ``[slots, E * out, R]``, expert e's B in rows ``[e * out, (e + 1) * out)``.
        num_experts: ``E``.

    Returns:
        ``(a_flat [slots * E, R, in], b_flat [slots * E, out, R])``; flat slot ``slot * E + e`` is expert
        ``e`` of ``slot``.

    Raises:
        OpArgumentError: a buffer's middle dimension is not a multiple of ``E``, or either is not contiguous.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[1] % num_experts or b.shape[1] % num_experts:
        raise OpArgumentError(
            f"expert buffers a {tuple(a.shape)} / b {tuple(b.shape)} do not hold {num_experts} experts "
            "(expected [slots, E * R, in] and [slots, E * out, R])"
        )
    if not (a.is_contiguous() and b.is_contiguous()):
        raise OpArgumentError("expert buffers must be contiguous (the device pool's are)")
    slots = a.shape[0]
    a_flat = a.view(slots * num_experts, a.shape[1] // num_experts, a.shape[2])
    b_flat = b.view(slots * num_experts, b.shape[1] // num_experts, b.shape[2])
    return a_flat, b_flat


def expert_lora_delta_(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: ExpertMeta
) -> torch.Tensor:
    """Adds every routed row's expert LoRA delta to ``out`` in place; returns ``out``.

    ``out[i] += scaling[slot, e] * B[slot, e, :, :rank] (A[slot, e, :rank] x[i])`` for each row ``i`` of a
    segment, ``(slot, e)`` the segment's flat slot; every other row of ``out`` is left bit-for-bit untouched.

    Args:
        out: ``[R, out]`` fp16/bf16/fp32, the rows' base projection output.
        x: ``[R, in]``, same dtype, the rows' projection input.
        a: ``[slots, E * R_max, in]`` and b: ``[slots, E * out, R_max]``: the experts group's pool buffers.
        meta: from :meth:`ExpertMeta.for_group`.

    Raises:
        OpArgumentError: as :func:`lora_pin.ops.shrink` and :func:`lora_pin.ops.expand`, or as
            :func:`flat_expert_buffers`.
    """
    a_flat, b_flat = flat_expert_buffers(a, b, meta.num_experts)
    expand(out, shrink(x, a_flat, meta.kernel), b_flat, meta.kernel)
    return out


def expert_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    row_experts: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
) -> torch.Tensor:
    """:func:`expert_lora_delta_`'s result from per-row slots and experts, in float64, with no segments:
    a loop over rows, written for clarity. ``out`` is not changed.

    Args:
        out: ``[R, out]``; x: ``[R, in]``.
        a: ``[slots, E * R_max, in]``; b: ``[slots, E * out, R_max]``.
        row_slots, row_experts: integer ``[R]`` (slot ``-1`` or an expert outside ``[0, E)``: no delta).
        slot_ranks: int ``[slots, E]``; slot_scalings: float ``[slots, E]``.
    """
    num_experts = slot_ranks.shape[1]
    max_rank = a.shape[1] // num_experts
    width = b.shape[1] // num_experts
    ranks, scalings = slot_ranks.tolist(), slot_scalings.tolist()
    new = out.clone()
    for row, (slot, expert) in enumerate(zip(row_slots.tolist(), row_experts.tolist(), strict=True)):
        if slot < 0 or not 0 <= expert < num_experts:
            continue
        rank = ranks[slot][expert]
        if rank == 0:
            continue
        a_e = a[slot, expert * max_rank : expert * max_rank + rank].double()
        b_e = b[slot, expert * width : (expert + 1) * width, :rank].double()
        delta = b_e @ (a_e @ x[row].double())
        new[row] = (out[row].double() + scalings[slot][expert] * delta).to(out.dtype)
    return new
