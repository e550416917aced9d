"""The paged shrink and expand in plain torch, for CPU tensors (:mod:`lora_pin.ops.paged`): each slot's
pages gathered into a contiguous block of its ranks, then one GEMM per slot and slice over the slot's
rows (all its segments together).

It reads the segment and page arrays on the host (a CPU path may; the CUDA path never does), so it
checks their contents first. Shrink computes in the input dtype (as ``lora_pin::shrink``'s torch path);
expand scales in fp32, adds in fp32 and rounds once to ``out``'s dtype, so a row's delta does not
overflow fp16 before it is added. Rows no segment with a slot covers, and rows of slots whose ranks are
all 0, are never written.
"""

from __future__ import annotations

import torch

from lora_pin.ops._checks import check_segment_contents
from lora_pin.ops.paged import (
    PageTable,
    check_page_contents,
    check_paged_expand_args,
    check_paged_shrink_args,
)
from lora_pin.ops.segments import KernelMeta

__all__ = ["paged_expand_torch", "paged_shrink_torch"]


def _slot_rows(meta: KernelMeta, ranks: list[list[int]]) -> dict[int, torch.Tensor]:
    """Each slot with work: the rows of all its segments (``perm``'s entries), in segment order."""
    indptr, seg_slots = meta.seg_indptr.tolist(), meta.seg_slots.tolist()
    spans: dict[int, list[torch.Tensor]] = {}
    for seg, slot in enumerate(seg_slots):
        if slot >= 0 and any(ranks[slot]) and indptr[seg + 1] > indptr[seg]:
            spans.setdefault(slot, []).append(meta.perm[indptr[seg] : indptr[seg + 1]])
    return {slot: torch.cat(parts) for slot, parts in spans.items()}


def _pages_of(pages: PageTable, slot: int) -> torch.Tensor:
    lo, hi = int(pages.page_indptr[slot]), int(pages.page_indptr[slot + 1])
    return pages.page_table[lo:hi].long()


def _check(
    meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int
) -> list[list[int]]:
    ranks = meta.ranks().tolist()
    check_segment_contents(
        meta.perm, meta.seg_indptr.tolist(), meta.seg_slots.tolist(), ranks, n_tokens, max_rank
    )
    check_page_contents(pages, ranks, num_pages)
    return ranks


def paged_shrink_torch(
    x: torch.Tensor, a_pages: torch.Tensor, pages: PageTable, meta: KernelMeta, max_rank: int
) -> torch.Tensor:
    """:func:`lora_pin.ops.triton_paged.paged_shrink` in torch: returns ``v`` ``[T, n_slices * R]`` in
    ``x.dtype``, zero where no segment covers the row and past each slice's rank.

    Args:
        x: ``[T, in]``; a_pages: ``[num_pages, n_slices * page_rank, in]``; pages: the page tables;
        meta: a layer group's; max_rank: ``R``.

    Raises:
        OpArgumentError: a shape, dtype or device mismatch, bad segment or page contents, or a rank
            above ``max_rank`` or above what a slot's pages hold.
    """
    check_paged_shrink_args(x, a_pages, pages, meta, max_rank)
    ranks = _check(meta, pages, x.shape[0], max_rank, a_pages.shape[0])
    n_slices, page_rank = meta.n_slices, pages.page_rank
    v = x.new_zeros(x.shape[0], n_slices * max_rank)
    for slot, rows in _slot_rows(meta, ranks).items():
        slot_pages = _pages_of(pages, slot)
        # [pages, n_slices, page_rank, in] -> [n_slices, pages * page_rank, in]: each slice's ranks in order.
        a_slot = (
            a_pages.index_select(0, slot_pages)
            .view(slot_pages.shape[0], n_slices, page_rank, -1)
            .transpose(0, 1)
            .reshape(n_slices, slot_pages.shape[0] * page_rank, -1)
        )
        xs = x.index_select(0, rows)
        vs = x.new_zeros(rows.shape[0], n_slices * max_rank)
        for s, rank in enumerate(ranks[slot]):
            if rank:
                vs[:, s * max_rank : s * max_rank + rank] = xs @ a_slot[s, :rank].T
        v.index_copy_(0, rows, vs)
    return v


def paged_expand_torch(
    out: torch.Tensor, v: torch.Tensor, b_pages: torch.Tensor, pages: PageTable, meta: KernelMeta
) -> None:
    """:func:`lora_pin.ops.triton_paged.paged_expand` in torch: ``out[rows, slice] += scaling * v @ B_sᵀ``
    in place.

    Args:
        out: ``[T, out_total]``; v: ``[T, n_slices * R]``; b_pages: ``[num_pages, out_total, page_rank]``;
        pages: the page tables; meta: a layer group's, with scalings and slice offsets.

    Raises:
        OpArgumentError: as :func:`paged_shrink_torch`, or ``meta`` lacks scalings or slice offsets.
            Nothing is written before every check has passed.
    """
    max_rank = check_paged_expand_args(out, v, b_pages, pages, meta)
    ranks = _check(meta, pages, out.shape[0], max_rank, b_pages.shape[0])
    slot_scalings, slice_offsets = meta.expand_layout()
    scalings = slot_scalings.tolist()
    for slot, rows in _slot_rows(meta, ranks).items():
        slot_pages = _pages_of(pages, slot)
        # [pages, out_total, page_rank] -> [out_total, pages * page_rank]: the slot's ranks in order.
        b_slot = b_pages.index_select(0, slot_pages).permute(1, 0, 2).reshape(out.shape[1], -1).float()
        vs = v.index_select(0, rows).float()
        new = out.index_select(0, rows).float()
        for s, rank in enumerate(ranks[slot]):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            if rank and hi > lo:
                delta = vs[:, s * max_rank : s * max_rank + rank] @ b_slot[lo:hi, :rank].T
                new[:, lo:hi] += scalings[slot][s] * delta
        out.index_copy_(0, rows, new.to(out.dtype))
