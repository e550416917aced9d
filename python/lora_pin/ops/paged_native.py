"""The paged shrink and expand (:mod:`lora_pin.ops.paged`) on the CPU's native kernels
(``lora_pin._core.CpuSgmvPlan.paged_shrink`` / ``paged_expand``, ``rust/kernels/src/sgmv/paged.rs``):
the slot layout's AVX-512 kernels, reading each slot's rank blocks through its page table.

Every slot with work runs in one native call per op, whatever its token count: a slot's ranks are
spread over pages, so the slot path's BLAS GEMMs on views of one slot's weights have no counterpart
here, and the kernels were measured against them on the same weights (``benches/cpu_ops.py --layout
pages``; BENCHMARKS.md, CPU ops). The shrink's groups are cut at ``_SHRINK_GROUP_ROWS`` tokens so a
group's rows of ``x`` stay in cache while the slot's A streams past them; the expand takes a slot's
rows whole (its panel path streams ``out`` row by row).

Where the native kernels do not apply (a CPU without AVX-512, ``LORA_PIN_CPU_KERNELS=0``, a device
other than the CPU, non-contiguous pools), the torch versions (:mod:`lora_pin.ops.paged_torch`) run
instead. The plan (groups, validated page tables) is built from the segment and page arrays on the
host and cached by their contents, so every layer of a step's layer group plans once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import NamedTuple

import torch

from lora_pin._core import CpuPageTable, CpuSgmvPlan
from lora_pin.ops._checks import check_expand_memory, check_segment_contents
from lora_pin.ops.grouped import kernel_ok
from lora_pin.ops.paged import (
    PageTable,
    check_page_contents,
    check_paged_expand_args,
    check_paged_shrink_args,
)
from lora_pin.ops.paged_torch import paged_expand_torch, paged_shrink_torch
from lora_pin.ops.segments import KernelMeta

__all__ = ["paged_expand_native", "paged_shrink_native"]

# Rows per group of the native shrink: the slot path's measured choice for long runs
# (grouped._RUN_SHRINK_ROWS), for the same reason (x's rows stay in cache while A streams past).
_SHRINK_GROUP_ROWS = 32
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Distinct plans kept: one per (step, layer group with its own ranks or pages).
_PLAN_CACHE_SIZE = 16


class PagedPlan(NamedTuple):
    """One step's native calls for one layer group: the validated tables and the groups per op."""

    pages: CpuPageTable
    # Every slot with work, its tokens cut into groups of at most _SHRINK_GROUP_ROWS; None: no work.
    shrink: CpuSgmvPlan | None
    # Every slot with work, its tokens in one group (the shrink's plan where no slot was cut).
    expand: CpuSgmvPlan | None


def _key(meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int) -> Hashable:
    tensors = (meta.perm, meta.seg_indptr, meta.seg_slots, meta.ranks(), pages.page_indptr, pages.page_table)
    contents = tuple((str(t.dtype), tuple(t.shape), t.contiguous().numpy().tobytes()) for t in tensors)
    return (n_tokens, max_rank, num_pages, pages.page_rank, contents)


def build_paged_plan(
    meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int
) -> PagedPlan:
    """Reads the segment and page arrays once, checking their contents, and groups every slot's tokens.

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
    if not spans:
        return PagedPlan(tables, None, None)
    rows = {slot: torch.cat(parts).tolist() for slot, parts in spans.items()}
    flat_ranks = [r for row in ranks for r in row]

    def plan(cut: int | None) -> CpuSgmvPlan:
        tokens: list[int] = []
        group_indptr, group_slots = [0], []
        for slot, slot_rows in rows.items():
            step = cut or len(slot_rows)
            for lo in range(0, len(slot_rows), step):
                tokens.extend(slot_rows[lo : lo + step])
                group_indptr.append(len(tokens))
                group_slots.append(slot)
        return CpuSgmvPlan(
            n_tokens, tokens, group_indptr, group_slots, flat_ranks, n_slices=meta.n_slices, max_rank=max_rank
        )

    expand = plan(None)
    cut = any(len(slot_rows) > _SHRINK_GROUP_ROWS for slot_rows in rows.values())
    return PagedPlan(tables, plan(_SHRINK_GROUP_ROWS) if cut else expand, expand)


class _PlanCache:
    """Plans keyed by the contents of the segment, rank and page arrays (never by identity: a buffer
    refilled in place, or a new tensor at a freed address, must not hit a stale plan)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._plans: OrderedDict[Hashable, PagedPlan] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int
    ) -> PagedPlan:
        key = _key(meta, pages, n_tokens, max_rank, num_pages)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = build_paged_plan(meta, pages, n_tokens, max_rank, num_pages)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan


_PLANS = _PlanCache(_PLAN_CACHE_SIZE)


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
    plan = _PLANS.get(meta, pages, x.shape[0], max_rank, a_pages.shape[0])
    v = x.new_zeros(x.shape[0], meta.n_slices * max_rank)
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
    plan = _PLANS.get(meta, pages, out.shape[0], max_rank, b_pages.shape[0])
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
