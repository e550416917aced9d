"""The paged shrink and expand ops (``lora_pin::paged_shrink``, ``lora_pin::paged_expand``): their bodies
per device and their Python faces, on a pool in rank pages (:mod:`lora_pin.ops.paged`).

Registered from :mod:`lora_pin.ops.library`'s table like the slot-layout ops: the schemas spell the
page tables out (``page_indptr``, ``page_table``, ``page_rank``) before the meta's fields. Dispatch:
CUDA tensors run the Triton paged kernels (:mod:`lora_pin.ops.triton_paged`); every other device runs
the native CPU kernels, or the torch version where they do not apply
(:mod:`lora_pin.ops.paged_native`). The fake bodies let ``torch.compile`` trace through the ops and
``torch.library.opcheck`` pass. For inference: no autograd formula is registered.
"""

from __future__ import annotations

import torch

from lora_pin.ops._checks import check_expand_memory, refuse_grad
from lora_pin.ops.custom_ops import expand_args
from lora_pin.ops.paged import PageTable, check_paged_expand_args, check_paged_shrink_args
from lora_pin.ops.paged_native import paged_expand_native, paged_shrink_native
from lora_pin.ops.segments import KernelMeta

__all__ = ["paged_expand", "paged_shrink"]


def _pages(page_indptr: torch.Tensor, page_table: torch.Tensor, page_rank: int) -> PageTable:
    return PageTable(page_indptr, page_table, page_rank)


def paged_shrink_default(
    x: torch.Tensor,
    a_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    page_table: torch.Tensor,
    page_rank: int,
    meta: KernelMeta,
    max_rank: int,
) -> torch.Tensor:
    return paged_shrink_native(x, a_pages, _pages(page_indptr, page_table, page_rank), meta, max_rank)


def paged_shrink_cuda(
    x: torch.Tensor,
    a_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    page_table: torch.Tensor,
    page_rank: int,
    meta: KernelMeta,
    max_rank: int,
) -> torch.Tensor:
    from lora_pin.ops.triton_paged import paged_shrink as triton_paged_shrink

    pages = _pages(page_indptr, page_table, page_rank)
    return triton_paged_shrink(x, a_pages, pages, meta, max_rank, interpret=False)


def paged_shrink_fake(
    x: torch.Tensor,
    a_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    page_table: torch.Tensor,
    page_rank: int,
    meta: KernelMeta,
    max_rank: int,
) -> torch.Tensor:
    check_paged_shrink_args(x, a_pages, _pages(page_indptr, page_table, page_rank), meta, max_rank)
    return x.new_empty(x.shape[0], meta.n_slices * max_rank)


def paged_expand_default(
    out: torch.Tensor,
    v: torch.Tensor,
    b_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    page_table: torch.Tensor,
    page_rank: int,
    meta: KernelMeta,
) -> None:
    paged_expand_native(out, v, b_pages, _pages(page_indptr, page_table, page_rank), meta)


def paged_expand_cuda(
    out: torch.Tensor,
    v: torch.Tensor,
    b_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    page_table: torch.Tensor,
    page_rank: int,
    meta: KernelMeta,
) -> None:
    from lora_pin.ops.triton_paged import paged_expand as triton_paged_expand

    check_expand_memory(out, v=v, b_pages=b_pages, slot_scalings=meta.expand_layout()[0])
    triton_paged_expand(out, v, b_pages, _pages(page_indptr, page_table, page_rank), meta, interpret=False)


def paged_expand_fake(
    out: torch.Tensor,
    v: torch.Tensor,
    b_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    page_table: torch.Tensor,
    page_rank: int,
    meta: KernelMeta,
) -> None:
    check_paged_expand_args(out, v, b_pages, _pages(page_indptr, page_table, page_rank), meta)


def paged_shrink(
    x: torch.Tensor, a_pages: torch.Tensor, pages: PageTable, meta: KernelMeta, max_rank: int
) -> torch.Tensor:
    """:func:`lora_pin.ops.shrink` on a pool in rank pages: ``v[t, s*R : s*R + rank] = x[t] @ A_sᵀ``,
    with slot ``slot(t)``'s A rows read through its pages.

    Args:
        x: ``[T, in]`` fp16/bf16/fp32, the layer input with tokens flattened.
        a_pages: ``[num_pages, n_slices * page_rank, in]``, ``x``'s dtype: the paged pool's A.
        pages: the slots' page tables (:class:`lora_pin.ops.paged.PageTable`): ``page_indptr``
            int32 ``[slots + 1]``, ``page_table`` int32 ``[P]``, ``page_rank``.
        meta: the step's segments in this layer group, with ``slot_ranks`` (:class:`KernelMeta`).
        max_rank: ``R``, each slice's block width in ``v``.

    Returns:
        ``v``: ``[T, n_slices * R]`` in ``x.dtype`` (fp32 accumulation); rows no segment covers, and
        the columns past each slice's rank, are zero.

    Raises:
        OpArgumentError: a shape, dtype or device mismatch naming the argument, or (CPU only: the CUDA
            path never reads tensor contents) a page outside the pool, a rank above ``max_rank`` or
            above what a slot's pages hold, or ``page_indptr`` not rising.
    """
    return torch.ops.lora_pin.paged_shrink(
        x,
        a_pages,
        pages.page_indptr,
        pages.page_table,
        pages.page_rank,
        meta.perm,
        meta.seg_indptr,
        meta.seg_slots,
        meta.ranks(),
        meta.n_slices,
        max_rank,
    )


def paged_expand(
    out: torch.Tensor, v: torch.Tensor, b_pages: torch.Tensor, pages: PageTable, meta: KernelMeta
) -> None:
    """:func:`lora_pin.ops.expand` on a pool in rank pages, in place: ``out[t, o_s:o_{s+1}] +=
    scaling[slot, s] * v[t, s*R : s*R + rank] @ B_sᵀ`` with B's rank columns read through the slot's
    pages; every row no segment with a slot covers is left bit for bit untouched.

    Args:
        out: ``[T, out_total]`` fp16/bf16/fp32, mutated in place.
        v: ``[T, n_slices * R]``, :func:`paged_shrink`'s output, ``out``'s dtype.
        b_pages: ``[num_pages, out_total, page_rank]``, ``out``'s dtype: the paged pool's B.
        pages: as for :func:`paged_shrink`.
        meta: as for :func:`paged_shrink`, with ``slot_scalings`` and ``slice_offsets``.

    Raises:
        OpArgumentError: as for :func:`paged_shrink`; ``meta`` lacks scalings or slice offsets; ``out``
            overlaps ``v``, ``b_pages`` or the scalings; or a tensor requires grad with grad mode on.
    """
    refuse_grad(out, v, b_pages)
    torch.ops.lora_pin.paged_expand(
        out, v, b_pages, pages.page_indptr, pages.page_table, pages.page_rank, *expand_args(meta)
    )
