"""A layer group's adapter pool in rank pages, read through page tables (issue 37): the layout, its
page table type and the checks the paged ops share.

The core plans the device tier in rank pages (``StepPlan.page_indptr`` / ``StepPlan.page_table``): an
adapter's *slot* is its first page, and slot ``s`` owns pages
``page_table[page_indptr[s]:page_indptr[s + 1]]``, in rank order. One layer group's pool is then

- ``a_pages``: ``[num_pages, n_slices * page_rank, in]``; rows ``s * page_rank : (s + 1) * page_rank``
  of page ``p`` are slice ``s``'s A rows for the ranks that page holds;
- ``b_pages``: ``[num_pages, out_total, page_rank]``; columns of page ``p`` are those ranks' B columns,
  for every slice (its rows cut at ``slice_offsets``).

This is the slot layout (``a [slots, n_slices * R, in]``, ``b [slots, out_total, R]``) with ``R`` cut
into pages of ``page_rank``: the ``j``-th page of a slot holds ranks ``[j * page_rank, (j + 1) *
page_rank)``, so the rank rows of one page are contiguous in A and its rank columns contiguous in B's
innermost dimension, and a kernel finds every rank by one page lookup. The last page's rows past the
slot's rank are zero, and the slot's real rank per slice (``slot_ranks``) bounds all work.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import MAX_SLICES
from lora_pin.ops._checks import _check_segments as check_segments
from lora_pin.ops.segments import KernelMeta

__all__ = [
    "PageTable",
    "check_page_contents",
    "check_page_tables",
    "check_paged_expand_args",
    "check_paged_shrink_args",
    "pages_from_slots",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class PageTable(NamedTuple):
    """Where each slot's ranks are in a paged pool.

    - ``page_indptr``: int32 ``[slots + 1]``; slot ``s`` owns
      ``page_table[page_indptr[s]:page_indptr[s + 1]]``.
    - ``page_table``: int32 ``[P]``, page indices into the pool, each slot's in rank order.
    - ``page_rank``: ranks per page (the pool's ``a_pages.shape[1] // n_slices``).
    """

    page_indptr: torch.Tensor  # int32 [slots + 1]
    page_table: torch.Tensor  # int32 [P]
    page_rank: int


def check_page_tables(pages: PageTable, meta: KernelMeta, device: torch.device) -> None:
    """Validates the page arrays' shapes, dtypes and device against ``meta``'s slots (metadata only:
    safe on the CUDA path and in a graph capture).

    Raises:
        OpArgumentError: ``page_rank`` is not positive, ``page_indptr`` is not int32 ``[slots + 1]``,
            ``page_table`` not int32 ``[P]``, or either is on another device than the activations.
    """
    page_indptr, page_table, page_rank = pages
    slots = meta.ranks().shape[0]
    if page_rank < 1:
        raise OpArgumentError(f"page_rank must be at least 1, got {page_rank}")
    if page_indptr.dim() != 1 or page_indptr.dtype != torch.int32 or page_indptr.shape[0] != slots + 1:
        raise OpArgumentError(
            f"page_indptr must be int32 [slots + 1 = {slots + 1}], "
            f"got {tuple(page_indptr.shape)} {page_indptr.dtype}"
        )
    if page_table.dim() != 1 or page_table.dtype != torch.int32:
        raise OpArgumentError(
            f"page_table must be int32 [P], got {tuple(page_table.shape)} {page_table.dtype}"
        )
    for name, t in (("page_indptr", page_indptr), ("page_table", page_table)):
        if t.device != device:
            raise OpArgumentError(f"{name} is on {t.device} but the activations are on {device}")


def _require(ok: bool, message: Callable[[], str]) -> None:
    """Raises ``message()`` unless ``ok``: the message is formatted only on failure (the checks run on
    every call)."""
    if not ok:
        raise OpArgumentError(message())


def _check_pool(pool: torch.Tensor, name: str, dtype: torch.dtype, device: torch.device) -> None:
    _require(pool.dim() == 3, lambda: f"{name} must be 3-D, got {tuple(pool.shape)}")
    _require(pool.dtype == dtype, lambda: f"{name} is {pool.dtype} but the activations are {dtype}")
    _require(pool.device == device, lambda: f"{name} is on {pool.device} but the activations are on {device}")


def check_paged_shrink_args(
    x: torch.Tensor, a_pages: torch.Tensor, pages: PageTable, meta: KernelMeta, max_rank: int
) -> None:
    """Validates a paged shrink's arguments (metadata only: safe on the CUDA path).

    Raises:
        OpArgumentError: the first mismatch found, naming the argument and its shape, dtype or device;
            or ``meta`` holds segments alone.
    """
    meta.ranks()  # a meta of segments alone is refused by name before anything reads it
    n_slices = meta.n_slices
    _require(
        x.dim() == 2 and x.dtype in _FLOAT_DTYPES,
        lambda: f"x must be fp16/bf16/fp32 [T, in], got {tuple(x.shape)} {x.dtype}",
    )
    _check_pool(a_pages, "a_pages", x.dtype, x.device)
    _require(1 <= n_slices <= MAX_SLICES, lambda: f"n_slices must be in [1, {MAX_SLICES}], got {n_slices}")
    _require(
        a_pages.shape[1] == n_slices * pages.page_rank and a_pages.shape[2] == x.shape[1],
        lambda: (
            f"a_pages must be [num_pages, n_slices * page_rank = {n_slices * pages.page_rank}, "
            f"in = {x.shape[1]}], got {tuple(a_pages.shape)}"
        ),
    )
    _require(max_rank >= 0, lambda: f"max_rank must be >= 0, got {max_rank}")
    check_segments(x.device, meta, x.shape[0])
    check_page_tables(pages, meta, x.device)


def check_paged_expand_args(
    out: torch.Tensor, v: torch.Tensor, b_pages: torch.Tensor, pages: PageTable, meta: KernelMeta
) -> int:
    """Validates a paged expand's arguments (metadata only); returns ``R``, each slice's width in ``v``.

    Raises:
        OpArgumentError: the first mismatch found, naming the argument; or ``meta`` lacks scalings or
            slice offsets, or the offsets do not rise from 0 to ``out_total``.
    """
    slot_scalings, slice_offsets = meta.expand_layout()
    n_slices, slot_ranks = len(slice_offsets) - 1, meta.ranks()
    _require(
        out.dim() == 2 and out.dtype in _FLOAT_DTYPES,
        lambda: f"out must be fp16/bf16/fp32 [T, out_total], got {tuple(out.shape)} {out.dtype}",
    )
    _require(
        1 <= n_slices <= MAX_SLICES and meta.n_slices == n_slices,
        lambda: (
            f"slice_offsets {list(slice_offsets)} must hold n_slices + 1 = {meta.n_slices + 1} ints, "
            f"with 1 <= n_slices <= {MAX_SLICES}"
        ),
    )
    _require(
        slice_offsets[0] == 0
        and slice_offsets[-1] == out.shape[1]
        and all(lo <= hi for lo, hi in itertools.pairwise(slice_offsets)),
        lambda: f"slice_offsets must rise from 0 to out_total={out.shape[1]}, got {list(slice_offsets)}",
    )
    _check_pool(b_pages, "b_pages", out.dtype, out.device)
    _require(
        b_pages.shape[1] == out.shape[1] and b_pages.shape[2] == pages.page_rank,
        lambda: (
            f"b_pages must be [num_pages, out_total = {out.shape[1]}, page_rank = {pages.page_rank}], "
            f"got {tuple(b_pages.shape)}"
        ),
    )
    _require(
        v.dim() == 2 and v.dtype == out.dtype and v.shape[0] == out.shape[0] and v.shape[1] % n_slices == 0,
        lambda: f"v must be {out.dtype} [T = {out.shape[0]}, n_slices * R], got {tuple(v.shape)} {v.dtype}",
    )
    _require(v.device == out.device, lambda: f"v is on {v.device} but out is on {out.device}")
    _require(
        slot_scalings.dtype == torch.float32
        and tuple(slot_scalings.shape) == (slot_ranks.shape[0], n_slices)
        and slot_scalings.device == out.device,
        lambda: (
            f"slot_scalings must be float32 [slots = {slot_ranks.shape[0]}, n_slices = {n_slices}] on "
            f"{out.device}, got {tuple(slot_scalings.shape)} {slot_scalings.dtype} on {slot_scalings.device}"
        ),
    )
    check_segments(out.device, meta, out.shape[0])
    check_page_tables(pages, meta, out.device)
    return v.shape[1] // n_slices


def check_page_contents(pages: PageTable, slot_ranks: list[list[int]], num_pages: int) -> None:
    """Validates what the page arrays hold (shapes checked already). Reads their contents, so it is for
    CPU tensors only (the references, the Triton interpreter): the CUDA path never does.

    Raises:
        OpArgumentError: ``page_indptr`` does not rise from 0 to ``len(page_table)``, a page is outside
            ``[0, num_pages)``, or a slot's rank in some slice exceeds the ranks its pages hold.
    """
    indptr = pages.page_indptr.tolist()
    n_entries = pages.page_table.shape[0]
    if indptr[0] != 0 or indptr[-1] != n_entries or any(lo > hi for lo, hi in itertools.pairwise(indptr)):
        raise OpArgumentError(f"page_indptr must rise from 0 to len(page_table)={n_entries}, got {indptr}")
    if n_entries:
        lowest, highest = (int(t) for t in torch.aminmax(pages.page_table))
        if lowest < 0 or highest >= num_pages:
            raise OpArgumentError(f"page_table holds pages outside [0, {num_pages}): {lowest}..{highest}")
    for slot, row in enumerate(slot_ranks):
        held = (indptr[slot + 1] - indptr[slot]) * pages.page_rank
        if max(row, default=0) > held:
            raise OpArgumentError(
                f"slot {slot} has ranks {row} but its {indptr[slot + 1] - indptr[slot]} pages of "
                f"page_rank={pages.page_rank} hold {held}"
            )


def pages_from_slots(
    a: torch.Tensor,
    b: torch.Tensor,
    slot_ranks: torch.Tensor,
    page_rank: int,
    *,
    spare_pages: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, PageTable]:
    """A slot-layout pool copied into a paged one (tests and benchmarks; the serving pool is filled by
    the loader). Each slot takes ``ceil(max rank / page_rank)`` pages (none at rank 0), drawn from a
    random permutation so a slot's pages are neither contiguous nor ascending.

    Args:
        a: ``[slots, n_slices * R, in]``; b: ``[slots, out_total, R]``.
        slot_ranks: int ``[slots, n_slices]``; rows and columns past a slice's rank are not copied.
        page_rank: ranks per page, at least 1.
        spare_pages: pages no slot owns, filled with NaN, so a kernel that reads a wrong page shows it.
        generator: source of the page order.

    Returns:
        ``(a_pages, b_pages, pages)``: ``[num_pages, n_slices * page_rank, in]``,
        ``[num_pages, out_total, page_rank]`` (a page's rows past its slot's rank zero) and the tables
        (on ``a``'s device).

    Raises:
        ValueError: ``page_rank`` or ``spare_pages`` out of range, or a rank above ``R``.
    """
    slots, n_slices = slot_ranks.shape
    max_rank = a.shape[1] // n_slices
    ranks = slot_ranks.tolist()
    if page_rank < 1 or spare_pages < 0:
        raise ValueError(f"page_rank must be >= 1 and spare_pages >= 0, got {page_rank}, {spare_pages}")
    if any(r > max_rank for row in ranks for r in row):
        raise ValueError(f"slot_ranks {ranks} exceed the pool's rank {max_rank}")
    counts = [-(-max(row, default=0) // page_rank) for row in ranks]
    num_pages = sum(counts) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()
    in_features, out_total = a.shape[2], b.shape[1]
    a_pages = a.new_full((num_pages, n_slices * page_rank, in_features), float("nan"))
    b_pages = b.new_full((num_pages, out_total, page_rank), float("nan"))
    indptr: list[int] = [0]
    table: list[int] = []
    for slot in range(slots):
        for j in range(counts[slot]):
            page = order[len(table)]
            table.append(page)
            a_pages[page].zero_()
            b_pages[page].zero_()
            for s in range(n_slices):
                # Ranks [lo, hi) of this slice live in this page; the rest of the page stays zero.
                lo, hi = j * page_rank, min((j + 1) * page_rank, ranks[slot][s])
                if hi > lo:
                    a_pages[page, s * page_rank : s * page_rank + hi - lo] = a[
                        slot, s * max_rank + lo : s * max_rank + hi
                    ]
            lo, hi = j * page_rank, min((j + 1) * page_rank, max_rank)
            b_pages[page, :, : hi - lo] = b[slot, :, lo:hi]
        indptr.append(len(table))
    device = a.device
    tables = PageTable(
        torch.tensor(indptr, dtype=torch.int32, device=device),
        torch.tensor(table, dtype=torch.int32, device=device),
        page_rank,
    )
    return a_pages, b_pages, tables
