"""The paged shrink and expand (:mod:`lora_pin.ops.paged`) on the CPU's native kernels
(``lora_pin._core.CpuSgmvPlan.paged_shrink`` / ``paged_expand``, ``rust/kernels/src/sgmv/paged.rs``):
the slot layout's AVX-512 kernels, reading each slot's rank blocks through its page table.

Every slot with work runs in one native call per op (a slot of more than ``_UNCUT_MAX_ROWS`` tokens has
its shrink cut into groups of ``_SHRINK_GROUP_ROWS``, so a group's rows of ``x`` stay in cache while
the slot's A streams past them; the expand takes a slot's rows whole, its panel path streaming ``out``
row by row), except a busy slot for which BLAS wins (:func:`lora_pin.ops.grouped.blas_runs` with
``paged``: bf16 past 64 tokens). Such a slot's rows run as GEMMs, on views of ``x`` / ``v`` / ``out``
where they are long runs of consecutive tokens, reading its page in place when it has one and else its
ranks gathered into one contiguous block per call (a copy of its weights). Where both ops have the same
groups (a decode step: no slot cut, none on GEMMs) they run as one native call, ``v`` in the kernels'
scratch (:func:`delta_planned`, as the slot layout's ``lora_delta``). Measured against the slot
layout on the same weights: ``benches/cpu_ops.py --layout pages`` (BENCHMARKS.md, CPU ops).

Where the native kernels do not apply (a CPU without AVX-512, ``LORA_PIN_CPU_KERNELS=0``, a device
other than the CPU, non-contiguous pools), the torch versions (:mod:`lora_pin.ops.paged_torch`) run
instead. The plan (groups, validated page tables: :func:`build_paged_plan`) is built from the segment
and page arrays on the host and kept in a small cache keyed by their contents (:func:`plan_for`), so
steps with the same segments and page tables (a steady decode) build it once: hashing the arrays costs
8-13 µs, building a plan 77-240 µs (8 to 32 slots, decode). The CPU backend looks its plans up once per
step and layer group and keeps them in the step's kernel state (:mod:`lora_pin.ops.backends.cpu_paged`),
running them by :func:`shrink_planned` and :func:`expand_planned`; the registered ops' bodies
(:func:`paged_shrink_native`, :func:`paged_expand_native`), which keep nothing between calls, look the
plan up on every call.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from lora_pin._core import CpuPageTable, CpuSgmvPlan
from lora_pin.ops._checks import check_expand_memory, check_segment_contents
from lora_pin.ops.grouped import blas_runs, kernel_ok, shrink_mm
from lora_pin.ops.paged import (
    PageTable,
    check_page_contents,
    check_paged_expand_args,
    check_paged_shrink_args,
)
from lora_pin.ops.paged_torch import paged_expand_torch, paged_shrink_torch
from lora_pin.ops.segments import KernelMeta

__all__ = [
    "BlasSlot",
    "PagedPlan",
    "build_paged_plan",
    "delta_planned",
    "expand_planned",
    "paged_expand_native",
    "paged_shrink_native",
    "plan_for",
    "shrink_planned",
]

# Rows per group of the native shrink: the slot path's measured choice for long runs
# (grouped._RUN_SHRINK_ROWS), for the same reason (x's rows stay in cache while A streams past).
_SHRINK_GROUP_ROWS = 32
# Slots of at most this many tokens keep their shrink in one group, as the slot path keeps the groups it
# hands the kernels (fp32: up to 64 tokens); cut in two, 64 fp32 decode tokens of one slot ran at
# 0.83x the slot layout (plain, 8 adapters, min of 15 cold rounds).
_UNCUT_MAX_ROWS = 64
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# A busy slot's rows taken as views when its runs of consecutive tokens are this long on average, else
# gathered (grouped._MIN_RUN's rule).
_MIN_RUN = 16
# Distinct plans kept: one per (step, layer group with its own ranks or pages).
_PLAN_CACHE_SIZE = 16


class BlasSlot(NamedTuple):
    """A busy slot whose op runs as GEMMs on its gathered pages."""

    slot: int
    # Its rank per slice.
    ranks: list[int]
    # Its pages, in rank order.
    pages: list[int]
    # int64 [Σ ranks]: the rows of a_pages viewed as [num_pages * n_slices * page_rank, in] that hold
    # its A, slice by slice, each slice's ranks in order; None for a slot of one page, whose A is a
    # view of that page (nothing gathered).
    a_rows: torch.Tensor | None
    # (first column in v, rank, first column in the shrink's product) of each slice with a rank.
    columns: list[tuple[int, int, int]]
    # (first token, count) of each run of consecutive tokens, when the rows are taken as views.
    runs: list[tuple[int, int]]
    # int64 [N]: its tokens, when they are gathered instead (runs too short); None otherwise.
    rows: torch.Tensor | None


class PagedPlan(NamedTuple):
    """One step's calls for one layer group: the validated tables, and per op the native kernels' groups
    and the slots that run as GEMMs instead."""

    pages: CpuPageTable
    # The native slots' tokens, a busy slot's cut into groups of _SHRINK_GROUP_ROWS; None: none.
    shrink: CpuSgmvPlan | None
    # The native slots' tokens, one group per slot; None: none.
    expand: CpuSgmvPlan | None
    blas_shrink: list[BlasSlot]
    blas_expand: list[BlasSlot]

    @property
    def shrink_empty(self) -> bool:
        """Whether the shrink has no work: no row uses a slot with a rank (``v`` stays zero)."""
        return self.shrink is None and not self.blas_shrink

    @property
    def expand_empty(self) -> bool:
        """Whether the expand has no work: no row uses a slot with a rank (``out`` stays as it was)."""
        return self.expand is None and not self.blas_expand

    @property
    def fused(self) -> bool:
        """Whether both ops run as one native call (:func:`delta_planned`): every slot with work on the
        native kernels with the same groups for both (none cut for the shrink, none on GEMMs)."""
        return (
            self.shrink is not None
            and self.shrink is self.expand
            and not self.blas_shrink
            and not self.blas_expand
        )


def _key(
    meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int, dtype: torch.dtype
) -> Hashable:
    tensors = (meta.perm, meta.seg_indptr, meta.seg_slots, meta.ranks(), pages.page_indptr, pages.page_table)
    contents = tuple((str(t.dtype), tuple(t.shape), t.contiguous().numpy().tobytes()) for t in tensors)
    return (n_tokens, max_rank, num_pages, pages.page_rank, str(dtype), contents)


def _blas_slot(slot: int, rows: list[int], pages: PageTable, ranks: list[int], max_rank: int) -> BlasSlot:
    lo, hi = int(pages.page_indptr[slot]), int(pages.page_indptr[slot + 1])
    page_list, page_rank, n_slices = pages.page_table[lo:hi].tolist(), pages.page_rank, len(ranks)
    a_index: torch.Tensor | None = None
    if len(page_list) == 1:
        columns = [(s * max_rank, rank, s * page_rank) for s, rank in enumerate(ranks) if rank]
    else:
        rows_of_a = [
            (page_list[j // page_rank] * n_slices + s) * page_rank + j % page_rank
            for s, rank in enumerate(ranks)
            for j in range(rank)
        ]
        a_index = torch.tensor(rows_of_a, dtype=torch.int64)
        starts = list(itertools.accumulate(ranks, initial=0))
        columns = [(s * max_rank, rank, starts[s]) for s, rank in enumerate(ranks) if rank]
    runs: list[tuple[int, int]] = []
    for token in rows:
        if runs and runs[-1][0] + runs[-1][1] == token:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((token, 1))
    if len(rows) >= _MIN_RUN * len(runs):
        return BlasSlot(slot, ranks, page_list, a_index, columns, runs, None)
    return BlasSlot(slot, ranks, page_list, a_index, columns, [], torch.tensor(rows, dtype=torch.int64))


def build_paged_plan(
    meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int, dtype: torch.dtype
) -> PagedPlan:
    """Reads the segment and page arrays once, checking their contents, and decides per slot and op:
    the native kernels, or GEMMs on the slot's gathered pages (:func:`lora_pin.ops.grouped.blas_runs`).

    The plan holds for any call with the same segment arrays (contents), ranks, page tables, ``n_tokens``
    (``x``'s rows), ``max_rank`` (``R``), ``num_pages`` and ``dtype``, whatever its pool's features.

    Raises:
        OpArgumentError: as :func:`lora_pin.ops.paged_torch.paged_shrink_torch` for bad contents.
    """
    ranks = meta.ranks().tolist()
    indptr, seg_slots = meta.seg_indptr.tolist(), meta.seg_slots.tolist()
    check_segment_contents(meta.perm, indptr, seg_slots, ranks, n_tokens, max_rank)
    check_page_contents(pages, ranks, num_pages)
    tables = CpuPageTable(
        pages.page_indptr.tolist(), pages.page_table.tolist(), page_rank=pages.page_rank, num_pages=num_pages
    )
    # Each slot's rows, its segments in order (the planner's chunks of one slot joined).
    spans: dict[int, list[torch.Tensor]] = {}
    for seg, slot in enumerate(seg_slots):
        if slot >= 0 and any(ranks[slot]) and indptr[seg + 1] > indptr[seg]:
            spans.setdefault(slot, []).append(meta.perm[indptr[seg] : indptr[seg + 1]])
    rows = {slot: torch.cat(parts).tolist() for slot, parts in spans.items()}
    blas = {slot: blas_runs(dtype, len(slot_rows), paged=True) for slot, slot_rows in rows.items()}
    flat_ranks = [r for row in ranks for r in row]

    def plan(op: int, cut: int | None) -> CpuSgmvPlan | None:
        tokens: list[int] = []
        group_indptr, group_slots = [0], []
        for slot, slot_rows in rows.items():
            if blas[slot][op]:
                continue
            step = cut if cut and len(slot_rows) > _UNCUT_MAX_ROWS else len(slot_rows)
            for lo in range(0, len(slot_rows), step):
                tokens.extend(slot_rows[lo : lo + step])
                group_indptr.append(len(tokens))
                group_slots.append(slot)
        if not group_slots:
            return None
        return CpuSgmvPlan(
            n_tokens, tokens, group_indptr, group_slots, flat_ranks, n_slices=meta.n_slices, max_rank=max_rank
        )

    blas_slots = {
        slot: _blas_slot(slot, slot_rows, pages, ranks[slot], max_rank)
        for slot, slot_rows in rows.items()
        if any(blas[slot])
    }
    # No slot cut for the shrink and none on GEMMs: both ops have the same groups, planned once (and
    # then run fused, v never leaving the kernels' scratch).
    same_groups = all(len(r) <= _UNCUT_MAX_ROWS for r in rows.values()) and not any(
        any(b) for b in blas.values()
    )
    shrink_plan = plan(0, _SHRINK_GROUP_ROWS)
    return PagedPlan(
        tables,
        shrink_plan,
        shrink_plan if same_groups else plan(1, None),
        [blas_slots[slot] for slot in rows if blas[slot][0]],
        [blas_slots[slot] for slot in rows if blas[slot][1]],
    )


class _PlanCache:
    """Plans keyed by the contents of the segment, rank and page arrays (never by identity: a buffer
    refilled in place, or a new tensor at a freed address, must not hit a stale plan)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._plans: OrderedDict[Hashable, PagedPlan] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self,
        meta: KernelMeta,
        pages: PageTable,
        n_tokens: int,
        max_rank: int,
        num_pages: int,
        dtype: torch.dtype,
    ) -> PagedPlan:
        key = _key(meta, pages, n_tokens, max_rank, num_pages, dtype)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = build_paged_plan(meta, pages, n_tokens, max_rank, num_pages, dtype)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan


_PLANS = _PlanCache(_PLAN_CACHE_SIZE)


def plan_for(
    meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int, dtype: torch.dtype
) -> PagedPlan:
    """The plan of ``meta`` and ``pages`` for these sizes, from the cache of plans by content (built on a
    miss, by :func:`build_paged_plan`, whose contents checks it runs then).

    Raises:
        OpArgumentError: as :func:`build_paged_plan`; nothing is cached then.
    """
    return _PLANS.get(meta, pages, n_tokens, max_rank, num_pages, dtype)


def _raw(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def _native(dtype: torch.dtype, meta: KernelMeta, pages: PageTable, *tensors: torch.Tensor) -> bool:
    tables = (meta.perm, meta.seg_indptr, meta.seg_slots, pages.page_indptr, pages.page_table)
    return kernel_ok(dtype, *tensors) and all(t.device.type == "cpu" for t in tables)


def paged_shrink_native(
    x: torch.Tensor, a_pages: torch.Tensor, pages: PageTable, meta: KernelMeta, max_rank: int
) -> torch.Tensor:
    """:func:`lora_pin.ops.paged_torch.paged_shrink_torch` on the native kernels: returns ``v``
    ``[T, n_slices * R]`` in ``x.dtype`` (fp32 accumulation, one rounding), zero where no segment
    covers the row and past each slice's rank.

    Args:
        x: ``[T, in]`` fp16/bf16/fp32; a_pages: ``[num_pages, n_slices * page_rank, in]``, ``x``'s
        dtype; pages: the page tables; meta: a layer group's; max_rank: ``R``.

    Raises:
        OpArgumentError: a shape, dtype or device mismatch, bad segment or page contents, or a rank
            above ``max_rank`` or above what a slot's pages hold (the checks of
            :mod:`lora_pin.ops.paged`).
    """
    check_paged_shrink_args(x, a_pages, pages, meta, max_rank)
    if not _native(x.dtype, meta, pages, a_pages):
        return paged_shrink_torch(x, a_pages, pages, meta, max_rank)
    plan = plan_for(meta, pages, x.shape[0], max_rank, a_pages.shape[0], x.dtype)
    return shrink_planned(x, a_pages, plan, meta.n_slices * max_rank)


def shrink_planned(x: torch.Tensor, a_pages: torch.Tensor, plan: PagedPlan, width: int) -> torch.Tensor:
    """The paged shrink by ``plan`` (checked already: nothing is checked here): ``v`` ``[T, width]``,
    ``width = n_slices * R``, zero where no segment covers the row and past each slice's rank.

    Args:
        x: ``[T, in]``; a_pages: ``[num_pages, n_slices * page_rank, in]``, ``x``'s dtype, contiguous;
        plan: :func:`build_paged_plan`'s for these arrays.
    """
    v = x.new_zeros(x.shape[0], width)
    if plan.shrink is not None:
        xc = x.contiguous()
        plan.shrink.paged_shrink(
            _DTYPES[x.dtype],
            _raw(xc),
            xc.shape[1],
            _raw(a_pages),
            plan.pages,
            _raw(v),
            threads=torch.get_num_threads(),
        )
    for busy in plan.blas_shrink:
        _shrink_blas(x, a_pages, v, busy)
    return v


def paged_expand_native(
    out: torch.Tensor, v: torch.Tensor, b_pages: torch.Tensor, pages: PageTable, meta: KernelMeta
) -> None:
    """:func:`lora_pin.ops.paged_torch.paged_expand_torch` on the native kernels:
    ``out[rows, slice] += scaling * v @ B_sᵀ`` in place (fp32 accumulation with ``out``'s value, one
    rounding); rows no segment with a slot covers are left bit for bit as they were.

    Args:
        out: ``[T, out_total]``; v: ``[T, n_slices * R]``; b_pages: ``[num_pages, out_total,
        page_rank]``; pages: the page tables; meta: a layer group's, with scalings and slice offsets.

    Raises:
        OpArgumentError: as :func:`paged_shrink_native`, or ``meta`` lacks scalings or slice offsets,
            or ``out`` shares memory with ``v``, ``b_pages`` or the scalings. Nothing is written
            before every check has passed.
    """
    max_rank = check_paged_expand_args(out, v, b_pages, pages, meta)
    slot_scalings, slice_offsets = meta.expand_layout()
    check_expand_memory(out, v=v, b_pages=b_pages, slot_scalings=slot_scalings)
    if not _native(out.dtype, meta, pages, out, b_pages, slot_scalings):
        paged_expand_torch(out, v, b_pages, pages, meta)
        return
    plan = plan_for(meta, pages, out.shape[0], max_rank, b_pages.shape[0], out.dtype)
    expand_planned(out, v, b_pages, plan, slot_scalings, slice_offsets, max_rank)


def expand_planned(
    out: torch.Tensor,
    v: torch.Tensor,
    b_pages: torch.Tensor,
    plan: PagedPlan,
    slot_scalings: torch.Tensor,
    slice_offsets: Sequence[int],
    max_rank: int,
) -> None:
    """The paged expand by ``plan`` (checked already: nothing is checked here), in place.

    Args:
        out: ``[T, out_total]``, contiguous; v: ``[T, n_slices * max_rank]``; b_pages: ``[num_pages,
        out_total, page_rank]``, contiguous; plan: :func:`build_paged_plan`'s for these arrays;
        slot_scalings: float32 ``[slots, n_slices]``, contiguous; slice_offsets: ``n_slices + 1`` ints.
    """
    if plan.expand is not None:
        vc = v.contiguous()
        plan.expand.paged_expand(
            _DTYPES[out.dtype],
            _raw(out),
            _raw(vc),
            _raw(b_pages),
            plan.pages,
            _raw(slot_scalings),
            list(slice_offsets),
            threads=torch.get_num_threads(),
        )
    if plan.blas_expand:
        scalings = slot_scalings.tolist()
        for busy in plan.blas_expand:
            _expand_blas(out, v, b_pages, busy, scalings[busy.slot], slice_offsets, max_rank)


def delta_planned(
    out: torch.Tensor,
    x: torch.Tensor,
    a_pages: torch.Tensor,
    b_pages: torch.Tensor,
    plan: PagedPlan,
    slot_scalings: torch.Tensor,
    slice_offsets: Sequence[int],
    max_rank: int,
) -> None:
    """The paged shrink then expand by ``plan`` (checked already: nothing is checked here), in place: one
    native call where the plan is :attr:`PagedPlan.fused` (``v`` stays in the kernels' scratch, as the
    slot layout's ``lora_delta``), else :func:`shrink_planned` and :func:`expand_planned`.

    Args:
        out: ``[T, out_total]``, contiguous; x: ``[T, in]``; a_pages, b_pages, slot_scalings,
        slice_offsets: as for those two; max_rank: ``R``.
    """
    if plan.fused:
        assert plan.shrink is not None
        xc = x.contiguous()
        plan.shrink.paged_lora_delta(
            _DTYPES[x.dtype],
            _raw(out),
            _raw(xc),
            xc.shape[1],
            _raw(a_pages),
            _raw(b_pages),
            plan.pages,
            _raw(slot_scalings),
            list(slice_offsets),
            threads=torch.get_num_threads(),
        )
        return
    v = shrink_planned(x, a_pages, plan, (len(slice_offsets) - 1) * max_rank)
    expand_planned(out, v, b_pages, plan, slot_scalings, slice_offsets, max_rank)


def _shrink_blas(
    x: torch.Tensor,  # [T, in]
    a_pages: torch.Tensor,  # [num_pages, n_slices * page_rank, in]
    v: torch.Tensor,  # [T, n_slices * R], zero where written
    busy: BlasSlot,
) -> None:
    """One busy slot's shrink as one GEMM per block of rows over all its slices, and the product's
    columns put in place: one GEMM for all slices rather than one per slice, so the GEMM packs the rows
    of ``x`` once. A slot of one page reads it in place; a longer one's A rows are gathered from its
    pages (only the ranks it has), one copy per call: on a loaded VM (copy bandwidth 6.6 GB/s) that
    copy is what a paged bf16 prefill pays over the slot layout."""
    if busy.a_rows is None:
        a_slot = a_pages[busy.pages[0]]  # [n_slices * page_rank, in], a view
    else:
        a_slot = a_pages.view(-1, a_pages.shape[2]).index_select(0, busy.a_rows)  # [Σ ranks, in]
    if busy.rows is None:
        blocks = [(x[start : start + n], v[start : start + n]) for start, n in busy.runs]
    else:
        gathered = x.new_zeros(busy.rows.shape[0], v.shape[1])
        blocks = [(x.index_select(0, busy.rows), gathered)]
    for xs, vs in blocks:
        if len(busy.columns) == 1:
            col, rank, at = busy.columns[0]
            shrink_mm(xs, a_slot[at : at + rank], out=vs[:, col : col + rank])
            continue
        product = shrink_mm(xs, a_slot)
        for col, rank, at in busy.columns:
            vs[:, col : col + rank] = product[:, at : at + rank]
    if busy.rows is not None:
        v.index_copy_(0, busy.rows, gathered)


def _expand_blas(
    out: torch.Tensor,  # [T, out_total], updated in place
    v: torch.Tensor,  # [T, n_slices * R]
    b_pages: torch.Tensor,  # [num_pages, out_total, page_rank]
    busy: BlasSlot,
    scalings: list[float],  # the slot's scaling per slice
    slice_offsets: Sequence[int],
    max_rank: int,
) -> None:
    """One busy slot's expand as GEMMs accumulating into ``out`` (fp32 accumulation, one rounding): a
    slot of one page reads it in place, a longer one's pages are gathered into ``[out_total, ranks]``."""
    # [out_total, pages * page_rank]: the slot's ranks in order, in one copy (a gather then a permuted
    # reshape copied twice: 0.28-0.31 against 0.16-0.18 ms for 4 bf16 pages of 4096 x 16, cold).
    if len(busy.pages) == 1:
        b_slot = b_pages[busy.pages[0]]  # a view
    else:
        b_slot = torch.cat([b_pages[page] for page in busy.pages], dim=1)
    if busy.rows is None:
        blocks = [(out[start : start + n], v[start : start + n]) for start, n in busy.runs]
    else:
        gathered = out.index_select(0, busy.rows)
        blocks = [(gathered, v.index_select(0, busy.rows))]
    for outs, vs in blocks:
        for s, rank in enumerate(busy.ranks):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            if rank and hi > lo:
                v_s = vs[:, s * max_rank : s * max_rank + rank]
                outs[:, lo:hi].addmm_(v_s, b_slot[lo:hi, :rank].T, alpha=scalings[s])
    if busy.rows is not None:
        out.index_copy_(0, busy.rows, gathered)
