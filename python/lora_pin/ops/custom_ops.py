"""The ``lora_pin::shrink`` and ``lora_pin::expand`` torch custom ops and their Python faces.

Dispatch: CUDA tensors run the Triton SGMV kernels (``triton_sgmv``); every other device runs the
grouped torch path (``grouped``). Both ops have fake impls, so ``torch.compile`` traces through them
(``fullgraph=True`` works) and ``torch.library.opcheck`` passes. They are for inference: no autograd
formula is registered.
"""

# No `from __future__ import annotations` here: torch.library reads the op schema from the annotations.

import operator

import torch

from lora_pin.ops._checks import (
    OpArgumentError,
    check_expand_args,
    check_expand_memory,
    check_shrink_args,
    refuse_grad,
)
from lora_pin.ops.grouped import delta_planned, expand_grouped, kernel_ok, plan_for, shrink_grouped
from lora_pin.ops.prepared import prepared_plan
from lora_pin.ops.segments import KernelMeta, expand_meta, shrink_meta

__all__ = ["expand", "lora_delta_", "shrink"]

# The registered ops below are the torch.library boundary: their schemas spell out the KernelMeta's
# fields one by one (torch.library has no type for it), and each implementation gathers them back into
# one KernelMeta before anything else runs.


def _shrink_fake(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
) -> torch.Tensor:
    max_rank = check_shrink_args(x, a, shrink_meta(perm, seg_indptr, seg_slots, slot_ranks, n_slices))
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
    meta = expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
    check_expand_args(out, v, b, meta)


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
    meta = shrink_meta(perm, seg_indptr, seg_slots, slot_ranks, n_slices)
    check_shrink_args(x, a, meta)
    return shrink_grouped(x, a, meta)


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

    meta = shrink_meta(perm, seg_indptr, seg_slots, slot_ranks, n_slices)
    return sgmv_shrink(x, a, meta, interpret=False)


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
    meta = expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
    check_expand_args(out, v, b, meta)
    check_expand_memory(out, v=v, b=b, slot_scalings=slot_scalings)
    expand_grouped(out, v, b, meta)


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
    meta = expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
    sgmv_expand(out, v, b, meta, interpret=False)


_expand_op.register_fake(_expand_fake)

# The fused op is registered at the dispatcher's level (a schema and one kernel per device) rather than
# through torch.library.custom_op, whose Python wrapper costs more than the rest of a small call: this op
# runs once per LoRA layer and step.
torch.library.define(
    "lora_pin::lora_delta_",
    "(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor perm, Tensor seg_indptr, Tensor seg_slots, "
    "Tensor slot_ranks, Tensor slot_scalings, int[] slice_offsets, int prepared=-1) -> ()",
)


@torch.library.impl("lora_pin::lora_delta_", "cpu")
def _lora_delta_cpu(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: list[int],
    prepared: int = -1,
) -> None:
    arrays = (perm, seg_indptr, seg_slots, slot_ranks, slot_scalings)
    plan = prepared_plan(prepared, out, x, a, b, arrays)
    if plan is None:
        meta = expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
        max_rank = check_shrink_args(x, a, meta)
        check_expand_args(out, x.new_empty(x.shape[0], meta.n_slices * max_rank), b, meta)
        check_expand_memory(out, x=x, a=a, b=b, slot_scalings=slot_scalings)
        kernel = kernel_ok(x.dtype, out, a, b, slot_scalings)
        plan = plan_for(meta, x.shape[0], max_rank, x.dtype, kernel)
    delta_planned(out, x, a, b, slot_scalings, slice_offsets, plan)


@torch.library.impl("lora_pin::lora_delta_", "cuda")
def _lora_delta_cuda(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: list[int],
    prepared: int = -1,
) -> None:
    from lora_pin.ops.triton_sgmv import sgmv_expand, sgmv_shrink

    meta = expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
    check_shrink_args(x, a, meta)
    check_expand_memory(out, a=a, b=b, slot_scalings=slot_scalings)
    sgmv_expand(out, sgmv_shrink(x, a, meta, interpret=False), b, meta, interpret=False)


@torch.library.register_fake("lora_pin::lora_delta_")
def _lora_delta_fake(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: list[int],
    prepared: int = -1,
) -> None:
    meta = expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
    max_rank = check_shrink_args(x, a, meta)
    check_expand_args(out, x.new_empty(x.shape[0], meta.n_slices * max_rank), b, meta)


def shrink(x: torch.Tensor, a: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    """LoRA shrink for a batch whose tokens use different adapters: ``v[t] = x[t] @ A[slot(t)]ᵀ``.

    Args:
        x: ``[T, in]`` fp16/bf16/fp32, the layer input with tokens flattened.
        a: ``[slots, n_slices * R, in]``, same dtype as ``x``: the device pool's stacked A buffer.
            Slice ``s`` of slot ``k`` is rows ``[s*R, s*R + slot_ranks[k, s])``; the rest is zero.
        meta: the step's segments in this layer group (:class:`KernelMeta`): ``perm`` int64 ``[N]``,
            ``N <= T``, the token indices of the rows that use an adapter, by segment; ``seg_indptr``
            int32 ``[S + 1]`` from 0 to ``N``; ``seg_slots`` int32 ``[S]`` (``-1`` skips a segment);
            ``slot_ranks`` int32 ``[slots, n_slices]``; ``n_slices``. Scalings and slice offsets are
            not read.

    Returns:
        ``v``: ``[T, n_slices * R]`` in ``x.dtype`` (fp32 accumulation); rows no segment covers, and
        the columns past each slice's rank, are zero.

    Raises:
        OpArgumentError: a shape, dtype or device mismatch, or (CPU only: the CUDA path never reads
            tensor contents) a rank, slot or index out of range.
    """
    return torch.ops.lora_pin.shrink(
        x, a, meta.perm, meta.seg_indptr, meta.seg_slots, meta.slot_ranks, meta.n_slices
    )


def expand(out: torch.Tensor, v: torch.Tensor, b: torch.Tensor, meta: KernelMeta) -> None:
    """LoRA expand, fused with the scaling and the add into the base layer's output, in place.

    ``out[t, o_s:o_{s+1}] += scaling[slot, s] * v[t, s*R : s*R + rank] @ b[slot, o_s:o_{s+1}, :rank]ᵀ``
    for every row of a segment whose slot is not ``-1``; every other row of ``out`` is left bit-for-bit
    untouched.

    Args:
        out: ``[T, out_total]`` fp16/bf16/fp32, mutated in place.
        v: ``[T, n_slices * R]``, :func:`shrink`'s output, same dtype as ``out``.
        b: ``[slots, out_total, R]``, same dtype as ``out``: the device pool's stacked B buffer.
        meta: as for :func:`shrink`, with ``slot_scalings`` float32 ``[slots, n_slices]`` and
            ``slice_offsets``, ``n_slices + 1`` ints from 0 to ``out_total`` (at most 8 slices; fused
            q/k/v under GQA have different widths, e.g. ``(0, 64, 80, 96)``).

    Raises:
        OpArgumentError: as for :func:`shrink`; ``meta`` lacks scalings or slice offsets, or its
            ``n_slices`` disagrees with them; ``out`` overlaps ``v`` or ``b``; a slice offset is not
            an int; or ``out``, ``v`` or ``b`` requires grad with grad mode on: the ops are for inference
            and the in-place add would silently drop the LoRA path from the gradient.
    """
    refuse_grad(out, v, b)
    slot_scalings, offsets = _expand_layout(meta)
    torch.ops.lora_pin.expand(
        out, v, b, meta.perm, meta.seg_indptr, meta.seg_slots, meta.slot_ranks, slot_scalings, offsets
    )


def _expand_layout(meta: KernelMeta) -> tuple[torch.Tensor, list[int]]:
    """``meta``'s scalings and slice offsets as the registered ops take them (the offsets as ints)."""
    slot_scalings, slice_offsets = meta.expand_layout()
    try:
        offsets = [operator.index(o) for o in slice_offsets]
    except TypeError:
        raise OpArgumentError(f"slice_offsets must be ints, got {list(slice_offsets)}") from None
    if meta.n_slices != len(offsets) - 1:
        raise OpArgumentError(
            f"n_slices={meta.n_slices} but slice_offsets {offsets} hold {len(offsets) - 1} slices"
        )
    return slot_scalings, offsets


def lora_delta_(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: KernelMeta
) -> torch.Tensor:
    """Adds every token's LoRA delta to ``out`` in place (:func:`shrink`, then :func:`expand`).

    Returns ``out``.

    Shapes and errors as for :func:`shrink` and :func:`expand`. One ``lora_pin::lora_delta_`` call: a
    caller that runs the same segments through many layers prepares them once instead
    (:func:`lora_pin.ops.prepare_delta`).
    """
    refuse_grad(out, x, a, b)
    slot_scalings, offsets = _expand_layout(meta)
    torch.ops.lora_pin.lora_delta_(
        out, x, a, b, meta.perm, meta.seg_indptr, meta.seg_slots, meta.slot_ranks, slot_scalings, offsets
    )
    return out
