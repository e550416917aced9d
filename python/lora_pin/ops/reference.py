"""Plain float64 references for the ``lora_pin`` ops: a loop over tokens, written for clarity, not speed.

Tests and ``benches/gpu_ops.py`` check every implementation against these. They compute in float64 on
the inputs' device and round once to the result dtype, so the only error they carry is that rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops.paged import PageTable, check_page_contents
from lora_pin.ops.segments import KernelMeta

__all__ = [
    "expand_reference",
    "lora_reference",
    "paged_expand_reference",
    "paged_shrink_reference",
    "shrink_reference",
]


def _segments(meta: KernelMeta) -> list[tuple[int, int]]:
    """(token, slot) for every row covered by a segment with a slot (slot >= 0)."""
    perm_l, indptr, slots = meta.perm.tolist(), meta.seg_indptr.tolist(), meta.seg_slots.tolist()
    return [
        (perm_l[i], slot)
        for s, slot in enumerate(slots)
        if slot >= 0
        for i in range(indptr[s], indptr[s + 1])
    ]


def shrink_reference(x: torch.Tensor, a: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    """``v[t, s*R : s*R + rank] = x[t] @ a[slot, s*R : s*R + rank]ᵀ``; see :func:`lora_pin.ops.shrink`.

    Returns ``[T, n_slices * R]`` in ``x.dtype`` (``R = a.shape[1] // n_slices``), zero where no segment
    with a slot covers the row and beyond each slice's rank.
    """
    n_slices = meta.n_slices
    max_rank = a.shape[1] // n_slices
    ranks = meta.ranks().tolist()
    v = torch.zeros(x.shape[0], n_slices * max_rank, dtype=torch.float64, device=x.device)
    for token, slot in _segments(meta):
        for s in range(n_slices):
            lo, hi = s * max_rank, s * max_rank + ranks[slot][s]
            v[token, lo:hi] = a[slot, lo:hi].double() @ x[token].double()
    return v.to(x.dtype)


def expand_reference(out: torch.Tensor, v: torch.Tensor, b: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    """What :func:`lora_pin.ops.expand` leaves in ``out``, as a new tensor (``out`` is not changed).

    For covered rows, slice ``s`` of ``new[t]`` is ``out[t, o_s:o_{s+1}]`` plus
    ``scaling[slot, s] * v[t, s*R : s*R + rank] @ b[slot, o_s:o_{s+1}, :rank]ᵀ``; every other row is a
    bit-exact copy of ``out``.
    """
    slot_scalings, slice_offsets = meta.expand_layout()
    n_slices = len(slice_offsets) - 1
    max_rank = b.shape[2]
    ranks, scalings = meta.ranks().tolist(), slot_scalings.tolist()
    new = out.clone()
    for token, slot in _segments(meta):
        for s in range(n_slices):
            rank = ranks[slot][s]
            if rank == 0:
                continue
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            delta = b[slot, lo:hi, :rank].double() @ v[token, s * max_rank : s * max_rank + rank].double()
            new[token, lo:hi] = (out[token, lo:hi].double() + scalings[slot][s] * delta).to(out.dtype)
    return new


def lora_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: Sequence[int],
) -> torch.Tensor:
    """The whole LoRA delta from a per-token slot map, independent of any segment arrays.

    ``new[t, slice s] = out[t, slice s] + scaling * (x[t] @ A_sᵀ) @ B_sᵀ`` in float64 with no
    intermediate rounding, for every token whose slot is not ``-1``; other rows are copied bit-exactly.

    Args:
        out: ``[T, out_total]``, the base layer's output (not changed).
        x: ``[T, in]``.
        a: ``[slots, n_slices * R, in]``; b: ``[slots, out_total, R]``.
        token_slots: integer ``[T]``, ``-1`` for no adapter.
        slot_ranks: int ``[slots, n_slices]``; slot_scalings: float ``[slots, n_slices]``.
        slice_offsets: ``n_slices + 1`` column offsets into ``out``.
    """
    n_slices = len(slice_offsets) - 1
    max_rank = b.shape[2]
    ranks, scalings = slot_ranks.tolist(), slot_scalings.tolist()
    new = out.clone()
    for token, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s in range(n_slices):
            rank = ranks[slot][s]
            if rank == 0:
                continue
            a_s = a[slot, s * max_rank : s * max_rank + rank].double()
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            delta = b[slot, lo:hi, :rank].double() @ (a_s @ x[token].double())
            new[token, lo:hi] = (out[token, lo:hi].double() + scalings[slot][s] * delta).to(out.dtype)
    return new


def _slot_ranks_block(
    pool: torch.Tensor, pages: PageTable, slot: int, rows: slice, rank: int
) -> torch.Tensor:
    """Ranks ``[0, rank)`` of one slot, its pages read in table order and joined along the rank axis:
    ``pool[page, rows]`` for A (``[rank, in]``), ``pool[page, rows].T`` for B (``[rank, out]``)."""
    lo, hi = pages.page_indptr[slot].item(), pages.page_indptr[slot + 1].item()
    blocks = [pool[page][rows].double() for page in pages.page_table[lo:hi].tolist()]
    return torch.cat(blocks)[:rank]


def paged_shrink_reference(
    x: torch.Tensor, a_pages: torch.Tensor, pages: PageTable, meta: KernelMeta, max_rank: int
) -> torch.Tensor:
    """:func:`shrink_reference` on a paged pool (:mod:`lora_pin.ops.paged`).

    Args:
        x: ``[T, in]``.
        a_pages: ``[num_pages, n_slices * page_rank, in]``.
        pages: the slots' page tables.
        meta: a layer group's (``slot_ranks`` bounds each slot's work).
        max_rank: ``R``, the width of each slice's block of ``v``.

    Returns:
        ``[T, n_slices * R]`` in ``x.dtype``, zero where no segment with a slot covers the row and past
        each slice's rank.

    Raises:
        OpArgumentError: a page table that does not cover its slot's rank or names a page outside the
            pool, or a rank above ``max_rank``.
    """
    n_slices, page_rank = meta.n_slices, pages.page_rank
    ranks = meta.ranks().tolist()
    check_page_contents(pages, ranks, a_pages.shape[0])
    if any(r > max_rank for row in ranks for r in row):
        raise OpArgumentError(f"slot_ranks {ranks} exceed max_rank={max_rank}")
    v = torch.zeros(x.shape[0], n_slices * max_rank, dtype=torch.float64, device=x.device)
    for token, slot in _segments(meta):
        for s in range(n_slices):
            rank = ranks[slot][s]
            if rank == 0:
                continue
            a_s = _slot_ranks_block(a_pages, pages, slot, slice(s * page_rank, (s + 1) * page_rank), rank)
            v[token, s * max_rank : s * max_rank + rank] = a_s @ x[token].double()
    return v.to(x.dtype)


def paged_expand_reference(
    out: torch.Tensor, v: torch.Tensor, b_pages: torch.Tensor, pages: PageTable, meta: KernelMeta
) -> torch.Tensor:
    """:func:`expand_reference` on a paged pool: what the paged expand leaves in ``out``, as a new
    tensor (``out`` is not changed).

    Args:
        out: ``[T, out_total]``.
        v: ``[T, n_slices * R]``, as the paged shrink returns it.
        b_pages: ``[num_pages, out_total, page_rank]``.
        pages: the slots' page tables.
        meta: a layer group's, with scalings and slice offsets.

    Raises:
        OpArgumentError: as :func:`paged_shrink_reference`.
    """
    slot_scalings, slice_offsets = meta.expand_layout()
    n_slices = len(slice_offsets) - 1
    max_rank = v.shape[1] // n_slices
    ranks, scalings = meta.ranks().tolist(), slot_scalings.tolist()
    check_page_contents(pages, ranks, b_pages.shape[0])
    if any(r > max_rank for row in ranks for r in row):
        raise OpArgumentError(f"slot_ranks {ranks} exceed v's rank {max_rank}")
    b_t = b_pages.transpose(1, 2)  # [num_pages, page_rank, out_total]: ranks first, as A's
    new = out.clone()
    for token, slot in _segments(meta):
        for s in range(n_slices):
            rank = ranks[slot][s]
            if rank == 0:
                continue
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            b_s = _slot_ranks_block(b_t, pages, slot, slice(None), rank)[:, lo:hi]  # [rank, out_s]
            delta = b_s.T @ v[token, s * max_rank : s * max_rank + rank].double()
            new[token, lo:hi] = (out[token, lo:hi].double() + scalings[slot][s] * delta).to(out.dtype)
    return new
