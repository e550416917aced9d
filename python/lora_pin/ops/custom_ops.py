"""The shrink, expand and fused delta ops: their bodies per device and their Python faces.

The bodies take the step's segments as one :class:`KernelMeta` (:mod:`lora_pin.ops.library` registers
them from its table, spelling the meta out field by field only in the schemas). Dispatch: CUDA tensors
run the Triton SGMV kernels (``triton_sgmv``); every other device runs the grouped torch path
(``grouped``). The fake bodies let ``torch.compile`` trace through the ops (``fullgraph=True`` works)
and ``torch.library.opcheck`` pass. They are for inference: no autograd formula is registered.
"""

from __future__ import annotations

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
from lora_pin.ops.segments import KernelMeta

__all__ = ["expand", "expand_args", "lora_delta_", "shrink"]


def shrink_torch(x: torch.Tensor, a: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    check_shrink_args(x, a, meta)
    return shrink_grouped(x, a, meta)


def shrink_cuda(x: torch.Tensor, a: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    from lora_pin.ops.triton_sgmv import sgmv_shrink

    return sgmv_shrink(x, a, meta, interpret=False)


def shrink_fake(x: torch.Tensor, a: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    max_rank = check_shrink_args(x, a, meta)
    return x.new_empty(x.shape[0], meta.n_slices * max_rank)


def expand_torch(out: torch.Tensor, v: torch.Tensor, b: torch.Tensor, meta: KernelMeta) -> None:
    check_expand_args(out, v, b, meta)
    check_expand_memory(out, v=v, b=b, slot_scalings=meta.expand_layout()[0])
    expand_grouped(out, v, b, meta)


def expand_cuda(out: torch.Tensor, v: torch.Tensor, b: torch.Tensor, meta: KernelMeta) -> None:
    from lora_pin.ops.triton_sgmv import sgmv_expand

    check_expand_memory(out, v=v, b=b, slot_scalings=meta.expand_layout()[0])
    sgmv_expand(out, v, b, meta, interpret=False)


def expand_fake(out: torch.Tensor, v: torch.Tensor, b: torch.Tensor, meta: KernelMeta) -> None:
    check_expand_args(out, v, b, meta)


def lora_delta_torch(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: KernelMeta
) -> None:
    slot_scalings, slice_offsets = meta.expand_layout()
    max_rank = check_shrink_args(x, a, meta)
    check_expand_args(out, x.new_empty(x.shape[0], meta.n_slices * max_rank), b, meta)
    check_expand_memory(out, x=x, a=a, b=b, slot_scalings=slot_scalings)
    kernel = kernel_ok(x.dtype, out, a, b, slot_scalings)
    plan = plan_for(meta, x.shape[0], max_rank, x.dtype, kernel)
    delta_planned(out, x, a, b, slot_scalings, list(slice_offsets), plan)


def lora_delta_cuda(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: KernelMeta
) -> None:
    from lora_pin.ops.triton_sgmv import sgmv_expand, sgmv_shrink

    check_shrink_args(x, a, meta)
    check_expand_memory(out, a=a, b=b, slot_scalings=meta.expand_layout()[0])
    sgmv_expand(out, sgmv_shrink(x, a, meta, interpret=False), b, meta, interpret=False)


def lora_delta_fake(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: KernelMeta
) -> None:
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
        x, a, meta.perm, meta.seg_indptr, meta.seg_slots, meta.ranks(), meta.n_slices
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
    torch.ops.lora_pin.expand(out, v, b, *expand_args(meta))


def expand_args(
    meta: KernelMeta,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """``meta`` as the ops that expand take it: ``perm, seg_indptr, seg_slots, slot_ranks,
    slot_scalings, slice_offsets`` (the offsets as ints).

    Raises:
        OpArgumentError: ``meta`` lacks scalings or slice offsets, an offset is not an int, or its
            ``n_slices`` disagrees with them.
    """
    slot_scalings, slice_offsets = meta.expand_layout()
    try:
        offsets = [operator.index(o) for o in slice_offsets]
    except TypeError:
        raise OpArgumentError(f"slice_offsets must be ints, got {list(slice_offsets)}") from None
    if meta.n_slices != len(offsets) - 1:
        raise OpArgumentError(
            f"n_slices={meta.n_slices} but slice_offsets {offsets} hold {len(offsets) - 1} slices"
        )
    return meta.perm, meta.seg_indptr, meta.seg_slots, meta.ranks(), slot_scalings, offsets


def lora_delta_(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: KernelMeta
) -> torch.Tensor:
    """Adds every token's LoRA delta to ``out`` in place (:func:`shrink`, then :func:`expand`).

    Returns ``out``.

    Shapes and errors as for :func:`shrink` and :func:`expand`. One ``lora_pin::lora_delta_`` call that
    checks and plans everything: the LoRA layers on the CPU plan once per step and group instead
    (:class:`lora_pin.ops.backends.CpuBackend`).
    """
    refuse_grad(out, x, a, b)
    torch.ops.lora_pin.lora_delta_(out, x, a, b, *expand_args(meta))
    return out
