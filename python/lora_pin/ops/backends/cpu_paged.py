"""The CPU backend's work on a paged pool (:class:`~lora_pin.weights.PagedDevicePool`): each layer
group's paged shrink and expand checked and planned once per step, then run by the plan.

The twin of the slot layout's ``CpuShrink`` / ``CpuExpand`` (:mod:`lora_pin.ops.backends.cpu`). On a
group's first call of the step, what ``lora_pin::paged_shrink`` / ``::paged_expand`` check on every call
is checked once: the shapes, dtypes and devices on stand-ins of the inputs, and the contents of the
segment and page arrays when the plan is built (:func:`lora_pin.ops.paged_native.build_paged_plan`).
A group of the same shapes, ranks and segments as one prepared earlier in the step takes its checks and
plan (``like``); any other group gets its plan from the step's :class:`PagedPlans`, which looks one up
per distinct segments, ranks, page tables and sizes in the cache of plans by content
(:func:`lora_pin.ops.paged_native.plan_for`: a step like the last one builds nothing) and hands it to
every group that matches. A model's groups mostly share their ranks, so a step hashes its arrays a few
times, whatever its layer count; every later call checks that its inputs have the shapes prepared for
and runs the kernels directly (no dispatcher, nothing hashed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import (
    check_expand_memory,
    check_prepared_expand,
    check_prepared_shrink,
    refuse_grad,
    same_tensor_kind,
    stand_in,
)
from lora_pin.ops.backends.base import SplitDelta, StepRows
from lora_pin.ops.backends.paged import step_pages
from lora_pin.ops.grouped import kernel_ok
from lora_pin.ops.paged import PageTable, check_paged_expand_args, check_paged_shrink_args
from lora_pin.ops.paged_native import PagedPlan, delta_planned, expand_planned, plan_for, shrink_planned
from lora_pin.ops.paged_torch import paged_expand_torch, paged_shrink_torch
from lora_pin.ops.segments import KernelMeta, same_segments
from lora_pin.weights.pool import GroupBuffers

__all__ = ["CpuPagedExpand", "CpuPagedShrink", "CpuPagedSplit", "PagedPlans", "prepare_paged"]


class PagedPlans:
    """One step's paged plans, shared between its layer groups: a group gets the plan of an earlier one
    when both have the step's segment arrays (the same tensors) with equal ranks, the step's page
    tables, and the same tokens, ``R``, page count and dtype; else one is looked up by content."""

    __slots__ = ("_plans",)

    def __init__(self) -> None:
        # (n_tokens, max_rank, num_pages, dtype) -> the (meta, pages, plan) looked up with them; the entry
        # holds the arrays, so the identities compared stay theirs.
        self._plans: dict[
            tuple[int, int, int, torch.dtype], list[tuple[KernelMeta, PageTable, PagedPlan]]
        ] = {}

    def get(
        self,
        meta: KernelMeta,
        pages: PageTable,
        n_tokens: int,
        max_rank: int,
        num_pages: int,
        dtype: torch.dtype,
    ) -> PagedPlan:
        """The plan of ``meta`` and ``pages`` for these sizes: the step's, or one looked up by content
        (built, and the arrays' contents checked, when no step had them).

        Raises:
            OpArgumentError: as :func:`lora_pin.ops.paged_native.build_paged_plan`; nothing is kept then.
        """
        known = self._plans.setdefault((n_tokens, max_rank, num_pages, dtype), [])
        for other_meta, other_pages, plan in known:
            if same_segments(meta, other_meta) and _same_pages(pages, other_pages):
                return plan
        plan = plan_for(meta, pages, n_tokens, max_rank, num_pages, dtype)
        known.append((meta, pages, plan))
        return plan


def _same_pages(pages: PageTable, other: PageTable) -> bool:
    """Whether two page tables are the same arrays (a step's, by identity: they are never written)."""
    return (
        pages.page_indptr is other.page_indptr
        and pages.page_table is other.page_table
        and pages.page_rank == other.page_rank
    )


class CpuPagedShrink:
    """One paged group's shrink in one step, for inputs ``[n_tokens, in]``. ``empty``: no row uses a
    slot with a rank in ``meta``'s ranks (``v`` is zero)."""

    __slots__ = (
        "a_pages",
        "dtype",
        "empty",
        "in_features",
        "max_rank",
        "meta",
        "n_tokens",
        "native",
        "pages",
        "plan",
    )

    def __init__(
        self,
        meta: KernelMeta,
        a_pages: torch.Tensor,
        pages: PageTable,
        n_tokens: int,
        max_rank: int,
        plan: PagedPlan,
    ) -> None:
        self.meta, self.a_pages, self.pages, self.plan = meta, a_pages, pages, plan
        self.n_tokens, self.in_features, self.max_rank = n_tokens, a_pages.shape[2], max_rank
        self.dtype = a_pages.dtype
        self.native = kernel_ok(a_pages.dtype, a_pages)
        self.empty = plan.shrink_empty

    @classmethod
    def prepare(
        cls,
        meta: KernelMeta,
        a_pages: torch.Tensor,
        pages: PageTable,
        n_tokens: int,
        max_rank: int,
        plans: PagedPlans,
        like: CpuPagedShrink | None = None,
    ) -> CpuPagedShrink:
        """Checks and plans the paged shrink of ``meta``'s segments over ``a_pages``
        ``[num_pages, n_slices * page_rank, in]`` through ``pages``, for ``n_tokens`` rows and
        ``max_rank`` (``R``). ``like``: another group's shrink of the step; when made for the same
        segment arrays with equal ranks, page tables, sizes and a pool of the same shape, dtype and
        device, its checks and plan hold here too and are reused.

        Raises:
            OpArgumentError: everything :func:`lora_pin.ops.paged_shrink` refuses on the CPU.
        """
        if (
            like is not None
            and n_tokens == like.n_tokens
            and max_rank == like.max_rank
            and same_tensor_kind(a_pages, like.a_pages)
            and _same_pages(pages, like.pages)
            and same_segments(meta, like.meta)
        ):
            return cls(meta, a_pages, pages, n_tokens, max_rank, like.plan)
        check_paged_shrink_args(stand_in(a_pages, n_tokens, a_pages.shape[2]), a_pages, pages, meta, max_rank)
        plan = plans.get(meta, pages, n_tokens, max_rank, a_pages.shape[0], a_pages.dtype)
        return cls(meta, a_pages, pages, n_tokens, max_rank, plan)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``v[t] = x[t]`` by ``slot(t)``'s A read through its pages: ``[n_tokens, n_slices * R]``, a new
        tensor (rows of no adapter and columns past each slice's rank zero).

        Raises:
            OpArgumentError: ``x`` has another shape or dtype than prepared for, or requires grad with
                grad mode on.
        """
        check_prepared_shrink("the paged LoRA shrink", self.dtype, self.n_tokens, self.in_features, x)
        width = self.meta.n_slices * self.max_rank
        if self.empty:
            return x.new_zeros(self.n_tokens, width)
        if not self.native:
            return paged_shrink_torch(x, self.a_pages, self.pages, self.meta, self.max_rank)
        return shrink_planned(x, self.a_pages, self.plan, width)


class CpuPagedExpand:
    """One paged group's expand in one step, into outputs ``[n_tokens, out_total]``. ``empty``: no row
    uses a slot with a rank in ``meta``'s ranks (the group's full ranks, the same on every process of a
    tensor-parallel group)."""

    __slots__ = (
        "b_pages",
        "dtype",
        "empty",
        "max_rank",
        "meta",
        "n_tokens",
        "native",
        "offsets",
        "out_total",
        "pages",
        "plan",
        "slot_scalings",
    )

    def __init__(
        self,
        meta: KernelMeta,
        b_pages: torch.Tensor,
        pages: PageTable,
        n_tokens: int,
        max_rank: int,
        plan: PagedPlan,
    ) -> None:
        self.meta, self.b_pages, self.pages, self.plan = meta, b_pages, pages, plan
        slot_scalings, offsets = meta.expand_layout()
        self.slot_scalings, self.offsets = slot_scalings, [int(o) for o in offsets]
        self.n_tokens, self.out_total, self.max_rank = n_tokens, b_pages.shape[1], max_rank
        self.dtype = b_pages.dtype
        self.native = kernel_ok(b_pages.dtype, b_pages, slot_scalings)
        self.empty = plan.expand_empty

    @classmethod
    def prepare(
        cls,
        meta: KernelMeta,
        b_pages: torch.Tensor,
        pages: PageTable,
        n_tokens: int,
        max_rank: int,
        plans: PagedPlans,
        like: CpuPagedExpand | None = None,
    ) -> CpuPagedExpand:
        """Checks and plans the paged expand of ``meta``'s segments (with scalings and slice offsets) over
        ``b_pages`` ``[num_pages, out_total, page_rank]`` through ``pages``, for ``v`` of ``max_rank``
        (``R``) columns a slice; ``like`` as for :meth:`CpuPagedShrink.prepare`, when the slice offsets
        and the scalings' kind match too.

        Raises:
            OpArgumentError: everything :func:`lora_pin.ops.paged_expand` refuses on the CPU but what
                depends on ``out`` and ``v`` themselves (checked per call).
        """
        slot_scalings, offsets = meta.expand_layout()
        if (
            like is not None
            and n_tokens == like.n_tokens
            and max_rank == like.max_rank
            and [int(o) for o in offsets] == like.offsets
            and same_tensor_kind(b_pages, like.b_pages)
            and same_tensor_kind(slot_scalings, like.slot_scalings)
            and _same_pages(pages, like.pages)
            and same_segments(meta, like.meta)
        ):
            return cls(meta, b_pages, pages, n_tokens, max_rank, like.plan)
        out_like = stand_in(b_pages, n_tokens, b_pages.shape[1])
        check_paged_expand_args(
            out_like, stand_in(b_pages, n_tokens, meta.n_slices * max_rank), b_pages, pages, meta
        )
        plan = plans.get(meta, pages, n_tokens, max_rank, b_pages.shape[0], b_pages.dtype)
        return cls(meta, b_pages, pages, n_tokens, max_rank, plan)

    def apply(self, out: torch.Tensor, v: torch.Tensor) -> None:
        """``out += scaling * v B[slot]ᵀ`` per slice, in place, B read through the slot's pages; rows of
        no adapter keep their values bit for bit. ``out`` may be a strided view (a row layer's column
        slice): the torch version then runs.

        Raises:
            OpArgumentError: ``out`` or ``v`` has another shape or dtype than prepared for, requires grad
                with grad mode on, or ``out`` shares memory with ``v``, B or the scalings. Nothing is
                written then.
        """
        width = self.meta.n_slices * self.max_rank
        check_prepared_expand(
            "the paged LoRA expand", self.dtype, self.n_tokens, self.out_total, width, out, v
        )
        check_expand_memory(out, v=v, b_pages=self.b_pages, slot_scalings=self.slot_scalings)
        if self.empty:
            return
        if not self.native or not out.is_contiguous():
            # The native kernels write contiguous rows only.
            paged_expand_torch(out, v, self.b_pages, self.pages, self.meta)
            return
        expand_planned(out, v, self.b_pages, self.plan, self.slot_scalings, self.offsets, self.max_rank)


class CpuPagedSplit(SplitDelta):
    """A paged group's :class:`CpuPagedShrink` and :class:`CpuPagedExpand` of one step: run apart as a
    :class:`SplitDelta`, or together by :meth:`apply`. ``empty``: the expand has no work."""

    __slots__ = ("empty", "expand_work", "shrink_work")

    def __init__(self, shrink_work: CpuPagedShrink, expand_work: CpuPagedExpand) -> None:
        self.shrink_work, self.expand_work = shrink_work, expand_work
        self.empty = expand_work.empty

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        return self.shrink_work.apply(x)

    def expand(self, out: torch.Tensor, v: torch.Tensor) -> None:
        self.expand_work.apply(out, v)

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out [n_tokens, out_total] += delta(x [n_tokens, in])`` in place: one native call when both
        ops have one plan that fuses them (:attr:`~lora_pin.ops.paged_native.PagedPlan.fused`, a decode
        step's usual case) and ``out`` is contiguous, else the shrink then the expand.

        Raises:
            OpArgumentError: as :meth:`CpuPagedShrink.apply` and :meth:`CpuPagedExpand.apply`.
        """
        shrink, expand = self.shrink_work, self.expand_work
        if not (shrink.plan is expand.plan and shrink.plan.fused and shrink.native and expand.native):
            expand.apply(out, shrink.apply(x))
            return
        check_prepared_shrink("the paged LoRA shrink", shrink.dtype, shrink.n_tokens, shrink.in_features, x)
        if out.dtype is not expand.dtype or out.shape != (expand.n_tokens, expand.out_total):
            raise OpArgumentError(
                f"the paged LoRA expand was prepared for out {expand.dtype} [{expand.n_tokens}, "
                f"{expand.out_total}], got out {out.dtype} {tuple(out.shape)}"
            )
        refuse_grad(out)
        # x is read whole into the kernels' scratch before out is written: only what expand reads counts.
        check_expand_memory(out, b_pages=expand.b_pages, slot_scalings=expand.slot_scalings)
        if not out.is_contiguous():
            expand.apply(out, shrink.apply(x))
            return
        delta_planned(
            out,
            x,
            shrink.a_pages,
            expand.b_pages,
            shrink.plan,
            expand.slot_scalings,
            expand.offsets,
            expand.max_rank,
        )


def prepare_paged(
    step: StepRows,
    buffers: GroupBuffers,
    x: torch.Tensor,
    slice_offsets: Sequence[int],
    shrink_ranks: Callable[[], torch.Tensor] | None,
    plans: PagedPlans,
    like: CpuPagedSplit | None = None,
) -> CpuPagedSplit:
    """A paged group's shrink and expand in ``step`` for input ``x`` (``[..., in]``), checked and planned
    (plans from ``plans``, the step's; checks and plans from ``like``, another group's of the step, where
    they hold); ``shrink_ranks`` as for ``LoRABackend.split_delta``.

    Raises:
        UsageError: as :meth:`StepRows.for_input`.
        OpArgumentError: as :func:`lora_pin.ops.backends.paged.step_pages`, or what the paged ops refuse.
    """
    pages = step_pages(step, buffers)
    meta = KernelMeta.for_layer(step.for_input(x), buffers.ranks, buffers.scalings, slice_offsets)
    local = meta if shrink_ranks is None else meta._replace(slot_ranks=shrink_ranks())
    assert buffers.max_rank is not None, "a paged group has its max rank"
    n_tokens = x.numel() // x.shape[-1]
    return CpuPagedSplit(
        CpuPagedShrink.prepare(
            local,
            buffers.a,
            pages,
            n_tokens,
            buffers.max_rank,
            plans,
            None if like is None else like.shrink_work,
        ),
        CpuPagedExpand.prepare(
            meta,
            buffers.b,
            pages,
            n_tokens,
            buffers.max_rank,
            plans,
            None if like is None else like.expand_work,
        ),
    )
