"""The ``lora_pin::shrink`` and ``lora_pin::expand`` torch custom ops and their Python faces.

Dispatch: CUDA tensors run the Triton SGMV kernels (``triton_sgmv``); every other device runs the
grouped torch path (``grouped``). Both ops have fake impls, so ``torch.compile`` traces through them
(``fullgraph=True`` works) and ``torch.library.opcheck`` passes. They are for inference: no autograd
formula is registered.
"""

# No `from __future__ import annotations` here: torch.library reads the op schema from the annotations.

import operator
from collections.abc import Sequence

import torch

from lora_pin.ops._checks import (
    OpArgumentError,
    check_expand_args,
    check_expand_memory,
    check_shrink_args,
)
from lora_pin.ops.grouped import expand_grouped, shrink_grouped
from lora_pin.ops.segments import SegmentBatch

__all__ = ["expand", "lora_delta_", "shrink"]


def _shrink_fake(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
) -> torch.Tensor:
    max_rank = check_shrink_args(x, a, perm, seg_indptr, seg_slots, slot_ranks, n_slices)
    return x.new_empty(x.shape[0], n_slices * max_rank)


def _expand_fake(
    out: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: list[int],
) -> None:
    check_expand_args(out, v, b, perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)


@torch.library.custom_op("lora_pin::shrink", mutates_args=())
def _shrink_op(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
) -> torch.Tensor:
    check_shrink_args(x, a, perm, seg_indptr, seg_slots, slot_ranks, n_slices)
    return shrink_grouped(x, a, perm, seg_indptr, seg_slots, slot_ranks, n_slices)


@_shrink_op.register_kernel("cuda")
def _shrink_cuda(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
) -> torch.Tensor:
    from lora_pin.ops.triton_sgmv import sgmv_shrink

    return sgmv_shrink(x, a, perm, seg_indptr, seg_slots, slot_ranks, n_slices, interpret=False)


_shrink_op.register_fake(_shrink_fake)


@torch.library.custom_op("lora_pin::expand", mutates_args=("out",))
def _expand_op(
    out: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: list[int],
) -> None:
    check_expand_args(out, v, b, perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
    check_expand_memory(out, v=v, b=b, slot_scalings=slot_scalings)
    expand_grouped(out, v, b, perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)


@_expand_op.register_kernel("cuda")
def _expand_cuda(
    out: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: list[int],
) -> None:
    from lora_pin.ops.triton_sgmv import sgmv_expand

    check_expand_memory(out, v=v, b=b, slot_scalings=slot_scalings)
    sgmv_expand(
        out, v, b, perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets, interpret=False
    )


_expand_op.register_fake(_expand_fake)


def shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
) -> torch.Tensor:
    """LoRA shrink for a batch whose tokens use different adapters: ``v[t] = x[t] @ A[slot(t)]ᵀ``.

    Args:
        x: ``[T, in]`` fp16/bf16/fp32, the layer input with tokens flattened.
        a: ``[slots, n_slices * R, in]``, same dtype as ``x``: the device pool's stacked A buffer.
            Slice ``s`` of slot ``k`` is rows ``[s*R, s*R + slot_ranks[k, s])``; the rest is zero.
        perm: int64 ``[N]``, ``N <= T``, token indices of the rows that use an adapter, by segment.
        seg_indptr: int32 ``[S + 1]``, from 0 to ``N``; segment ``s`` is
            ``perm[seg_indptr[s]:seg_indptr[s+1]]``.
        seg_slots: int32 ``[S]``, slot of each segment; ``-1`` skips the segment.
        slot_ranks: int32 ``[slots, n_slices]``, each slot's real rank per slice (0: no work).
        n_slices: 1 for a plain layer, 3 for fused q/k/v, 2 for gate/up.

    Returns:
        ``v``: ``[T, n_slices * R]`` in ``x.dtype`` (fp32 accumulation); rows no segment covers, and
        the columns past each slice's rank, are zero.

    Raises:
        OpArgumentError: a shape, dtype or device mismatch, or (CPU only: the CUDA path never reads
            tensor contents) a rank, slot or index out of range.
    """
    return torch.ops.lora_pin.shrink(x, a, perm, seg_indptr, seg_slots, slot_ranks, n_slices)


def expand(
    out: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """LoRA expand, fused with the scaling and the add into the base layer's output, in place.

    ``out[t, o_s:o_{s+1}] += scaling[slot, s] * v[t, s*R : s*R + rank] @ b[slot, o_s:o_{s+1}, :rank]ᵀ``
    for every row of a segment whose slot is not ``-1``; every other row of ``out`` is left bit-for-bit
    untouched.

    Args:
        out: ``[T, out_total]`` fp16/bf16/fp32, mutated in place.
        v: ``[T, n_slices * R]``, :func:`shrink`'s output, same dtype as ``out``.
        b: ``[slots, out_total, R]``, same dtype as ``out``: the device pool's stacked B buffer.
        perm, seg_indptr, seg_slots, slot_ranks: as for :func:`shrink`.
        slot_scalings: float32 ``[slots, n_slices]``.
        slice_offsets: ``n_slices + 1`` ints from 0 to ``out_total`` (at most 8 slices); fused q/k/v
            under GQA have different widths, e.g. ``[0, 64, 80, 96]``.

    Raises:
        OpArgumentError: as for :func:`shrink`; ``out`` overlaps ``v`` or ``b``; a slice offset is not
            an int; or ``out``, ``v`` or ``b`` requires grad with grad mode on: the ops are for inference
            and the in-place add would silently drop the LoRA path from the gradient.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (out, v, b)):
        raise OpArgumentError(
            "lora_pin ops have no autograd formula; run them under torch.inference_mode() or torch.no_grad()"
        )
    try:
        offsets = [operator.index(o) for o in slice_offsets]
    except TypeError:
        raise OpArgumentError(f"slice_offsets must be ints, got {list(slice_offsets)}") from None
    torch.ops.lora_pin.expand(out, v, b, perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, offsets)


def lora_delta_(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: SegmentBatch,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: Sequence[int],
) -> torch.Tensor:
    """Adds every token's LoRA delta to ``out`` in place (:func:`shrink`, then :func:`expand`).

    Returns ``out``.

    Shapes as for :func:`shrink` and :func:`expand`; ``n_slices = len(slice_offsets) - 1``.
    """
    n_slices = len(slice_offsets) - 1
    v = shrink(x, a, batch.perm, batch.seg_indptr, batch.seg_slots, slot_ranks, n_slices)
    expand(out, v, b, batch.perm, batch.seg_indptr, batch.seg_slots, slot_ranks, slot_scalings, slice_offsets)
    return out
