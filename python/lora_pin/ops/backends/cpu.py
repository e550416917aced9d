"""The CPU backend: each layer group's work checked and planned once per step, then run by its plan.

Every layer of a group runs the same segments over the same pool buffers in a step, so what the ops
would check and plan on every call (the segment arrays' shapes and contents, the pool's shapes, which
rows go to the native kernels, to batched GEMMs, to views or to a gathered block: a
:class:`~lora_pin.ops.grouped.CpuOpPlan`) is done on the group's first call of the step and kept in
the step's :class:`CpuStepKernels`. A call then costs a few shape checks and the kernels themselves,
run directly (no dispatcher, no handle to look a plan up by); a group that no row of the step uses
costs nothing. Groups of one shape share the plan of the first one when their ranks agree.

While ``torch.compile`` traces a layer, the work goes through the registered ops instead
(:class:`~lora_pin.ops.backends.fallback.TorchOpsBackend`), whose fake bodies it reads; reading the
arrays on the host here would break the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import (
    check_expand_args,
    check_prepared_expand,
    check_prepared_shrink,
    check_shrink_args,
    refuse_grad,
    same_tensor_kind,
    stand_in,
)
from lora_pin.ops.backends.base import LoRABackend, SplitDelta, StepRows, embed_scale_tensor
from lora_pin.ops.backends.cpu_paged import CpuPagedSplit, PagedPlans, prepare_paged
from lora_pin.ops.backends.fallback import TorchOpsBackend
from lora_pin.ops.custom_ops import expand_args
from lora_pin.ops.dora import scale_rows_
from lora_pin.ops.embedding import check_embedding_args, lookup_expand, used_rows
from lora_pin.ops.grouped import CpuOpPlan, delta_planned, expand_planned, kernel_ok, plan_for, shrink_planned
from lora_pin.ops.segments import KernelMeta, same_segments
from lora_pin.weights.pool import GroupBuffers

__all__ = ["CpuBackend", "CpuStepKernels", "rows_in_slots"]


class CpuBackend(LoRABackend):
    """The LoRA layers' work on CPU tensors in eager mode (see the module). One instance serves a model:
    it keeps the kernel state of the step its layers run now (:class:`CpuStepKernels`), replaced when
    another step comes. Not thread-safe, as a manager's steps are not run concurrently."""

    def __init__(self) -> None:
        self._traced = TorchOpsBackend()
        self._kernels: CpuStepKernels | None = None

    def kernels(self, step: StepRows) -> CpuStepKernels:
        """The kernel state of ``step``: the one kept if it is the same step, else a new one."""
        kernels = self._kernels
        if kernels is None or kernels.step is not step:
            kernels = self._kernels = CpuStepKernels(step)
        return kernels

    def add_lora_linear(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        out: torch.Tensor,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        dora_bias: Callable[[], torch.Tensor | None],
    ) -> None:
        if torch.compiler.is_compiling():
            self._traced.add_lora_linear(step, buffers, out, x, slice_offsets, dora_bias)
            return
        kernels = self.kernels(step)
        if buffers.page_rank is not None:
            paged = kernels.paged(buffers, x, slice_offsets, None)
            if not paged.empty:
                paged.apply(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]))
        else:
            delta = kernels.delta(buffers, x, slice_offsets)
            if not delta.empty:
                delta.apply(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]))
        if buffers.dora_slots:
            rows = kernels.dora_rows(buffers, x)
            if rows is not None:
                assert buffers.factors is not None
                # Exactly the step's DoRA rows, from its own arrays: no checks or filter left to do.
                scale_rows_(out.view(-1, out.shape[-1]), dora_bias(), buffers.factors, *rows)

    def add_lora_embedding(
        self, step: StepRows, buffers: GroupBuffers, out: torch.Tensor, ids: torch.Tensor, embed_scale: object
    ) -> None:
        if torch.compiler.is_compiling():
            self._traced.add_lora_embedding(step, buffers, out, ids, embed_scale)
            return
        delta = self.kernels(step).embedding_delta(buffers, out, embed_scale)
        if not delta.empty:
            delta.apply(out.view(-1, out.shape[-1]), ids.reshape(-1).long())

    def split_delta(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        shrink_ranks: Callable[[], torch.Tensor] | None,
    ) -> SplitDelta | None:
        if torch.compiler.is_compiling():
            return self._traced.split_delta(step, buffers, x, slice_offsets, shrink_ranks)
        kernels = self.kernels(step)
        if buffers.page_rank is not None:
            paged = kernels.paged(buffers, x, slice_offsets, shrink_ranks)
            return None if paged.empty else paged
        split = kernels.split_delta(buffers, x, slice_offsets, shrink_ranks)
        return None if split.expand_work.empty else split


class CpuStepKernels:
    """One step's kernel state on the CPU: each layer group's checked and planned work, by group and
    input shape, made on the group's first call of the step (a paged pool's too: :meth:`paged`).

    Args:
        step: the step (its :meth:`~StepRows.for_input` gives the segments of an input).
    """

    __slots__ = (
        "_deltas",
        "_dora_rows",
        "_embeddings",
        "_paged",
        "_paged_plans",
        "_paged_shared",
        "_shared",
        "_split_shared",
        "_splits",
        "step",
    )

    def __init__(self, step: StepRows) -> None:
        self.step = step
        # Keys hold the identity of a group's A buffer, which the entry holds, so the id stays its own.
        # (A, input shape less features) -> the group's fused delta.
        self._deltas: dict[tuple[int, torch.Size], CpuDelta] = {}
        # (input shape less features, A's shape, B's shape) -> the last group planned in full with them.
        self._shared: dict[tuple[torch.Size, ...], CpuDelta] = {}
        # (A, input shape less features) -> the group's shrink and expand, run apart.
        self._splits: dict[tuple[int, torch.Size], CpuSplit] = {}
        # As _shared, for the shrinks and expands run apart.
        self._split_shared: dict[tuple[torch.Size, ...], CpuSplit] = {}
        # (embedding group's A, output shape less features) -> its delta.
        self._embeddings: dict[tuple[int, torch.Size], CpuEmbeddingDelta] = {}
        # (DoRA slots of a group, input shape less features) -> the step's rows in them and their slots.
        self._dora_rows: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor] | None] = {}
        # (paged group's A, input shape less features, run apart) -> its shrink and expand.
        self._paged: dict[tuple[int, torch.Size, bool], CpuPagedSplit] = {}
        # (input shape less features, A's shape, B's shape, run apart) -> the last paged group planned in
        # full with them.
        self._paged_shared: dict[tuple[Any, ...], CpuPagedSplit] = {}
        # The step's paged plans, shared between its paged groups.
        self._paged_plans = PagedPlans()

    def delta(self, buffers: GroupBuffers, x: torch.Tensor, slice_offsets: Sequence[int]) -> CpuDelta:
        """The step's fused LoRA delta in ``buffers``' group for input ``x`` (``[..., in]``).

        Raises:
            UsageError: as :meth:`StepRows.for_input`.
            OpArgumentError: what :func:`lora_pin.ops.lora_delta_` refuses, checked once here.
        """
        key = (id(buffers.a), x.shape[:-1])
        delta = self._deltas.get(key)
        if delta is None:
            meta = KernelMeta.for_layer(
                self.step.for_input(x), buffers.ranks, buffers.scalings, slice_offsets
            )
            # Each layer runs once a step: groups of one shape share the checks and plan of the first.
            shape_key = (x.shape[:-1], buffers.a.shape, buffers.b.shape)
            like = self._shared.get(shape_key)
            delta = CpuDelta.prepare(meta, buffers.a, buffers.b, x.numel() // x.shape[-1], like)
            if like is None or delta.plan is not like.plan:
                self._shared[shape_key] = delta
            self._deltas[key] = delta
        return delta

    def split_delta(
        self,
        buffers: GroupBuffers,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        shrink_ranks: Callable[[], torch.Tensor] | None,
    ) -> CpuSplit:
        """The step's shrink and expand in ``buffers``' group for input ``x``, run apart (see
        :meth:`LoRABackend.split_delta`); ``shrink_ranks`` is called on the group's first call only.

        Raises:
            UsageError: as :meth:`StepRows.for_input`.
            OpArgumentError: what :func:`lora_pin.ops.shrink` and :func:`~lora_pin.ops.expand` refuse.
        """
        key = (id(buffers.a), x.shape[:-1])
        split = self._splits.get(key)
        if split is None:
            meta = KernelMeta.for_layer(
                self.step.for_input(x), buffers.ranks, buffers.scalings, slice_offsets
            )
            local = meta if shrink_ranks is None else meta._replace(slot_ranks=shrink_ranks())
            n_tokens = x.numel() // x.shape[-1]
            shape_key = (x.shape[:-1], buffers.a.shape, buffers.b.shape)
            like = self._split_shared.get(shape_key)
            split = CpuSplit(
                CpuShrink.prepare(local, buffers.a, n_tokens, None if like is None else like.shrink_work),
                CpuExpand.prepare(meta, buffers.b, n_tokens, None if like is None else like.expand_work),
            )
            if (
                like is None
                or split.shrink_work.plan is not like.shrink_work.plan
                or split.expand_work.plan is not like.expand_work.plan
            ):
                self._split_shared[shape_key] = split
            self._splits[key] = split
        return split

    def paged(
        self,
        buffers: GroupBuffers,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        shrink_ranks: Callable[[], torch.Tensor] | None,
    ) -> CpuPagedSplit:
        """The step's shrink and expand in a paged group (``buffers.page_rank`` set) for input ``x``,
        through the step's page tables: run together (``shrink_ranks`` None) or apart (see
        :meth:`LoRABackend.split_delta`; ``shrink_ranks`` is called on the group's first call only).

        Raises:
            UsageError: as :meth:`StepRows.for_input`.
            OpArgumentError: the step carries no page tables of the group's ``page_rank``, or what
                :func:`lora_pin.ops.paged_shrink` and :func:`~lora_pin.ops.paged_expand` refuse.
        """
        key = (id(buffers.a), x.shape[:-1], shrink_ranks is not None)
        paged = self._paged.get(key)
        if paged is None:
            # Groups of one shape share the checks and plan of the first (as the slot layout's do).
            shape_key = (x.shape[:-1], buffers.a.shape, buffers.b.shape, shrink_ranks is not None)
            like = self._paged_shared.get(shape_key)
            paged = prepare_paged(self.step, buffers, x, slice_offsets, shrink_ranks, self._paged_plans, like)
            if (
                like is None
                or paged.shrink_work.plan is not like.shrink_work.plan
                or paged.expand_work.plan is not like.expand_work.plan
            ):
                self._paged_shared[shape_key] = paged
            self._paged[key] = paged
        return paged

    def embedding_delta(
        self, buffers: GroupBuffers, out: torch.Tensor, embed_scale: object
    ) -> CpuEmbeddingDelta:
        """The step's LoRA delta in the embedding group of ``buffers`` for its output ``out``
        (``[..., dim]``); ``embed_scale`` is rounded to the pool's dtype as the device path rounds it.

        Raises:
            UsageError: as :meth:`StepRows.for_input`.
            OpArgumentError: what :func:`lora_pin.ops.embedding_delta_` refuses, checked once here.
        """
        key = (id(buffers.a), out.shape[:-1])
        delta = self._embeddings.get(key)
        if delta is None:
            seg = self.step.for_input(out)
            meta = KernelMeta.for_layer(seg, buffers.ranks, buffers.scalings, buffers.slice_offsets)
            scale = embed_scale_tensor(embed_scale, torch.empty(0, dtype=out.dtype))
            n_tokens = out.numel() // out.shape[-1]
            delta = CpuEmbeddingDelta.prepare(
                meta, buffers.a, buffers.b, n_tokens, 1.0 if scale is None else float(scale)
            )
            self._embeddings[key] = delta
        return delta

    def dora_rows(self, buffers: GroupBuffers, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of layer input ``x`` in the group's DoRA slots and their slots (int64 ``[N]`` each,
        as :func:`lora_pin.ops.dora.scale_rows_` takes them), read from the step's arrays; None when
        there are none. Made once per step, DoRA slots and input shape.

        Raises:
            UsageError: as :meth:`StepRows.for_input`.
        """
        dora_slots = buffers.dora_slots
        if not dora_slots:
            return None
        key = (frozenset(dora_slots), x.shape[:-1])
        if key in self._dora_rows:
            return self._dora_rows[key]
        rows = rows_in_slots(self.step.for_input(x), dora_slots)
        self._dora_rows[key] = rows
        return rows


def rows_in_slots(seg: KernelMeta, slots: Collection[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of ``seg`` whose slot is one of ``slots`` and those slots, int64 ``[N]`` each (what
    :func:`lora_pin.ops.dora.scale_rows_` takes: a step's DoRA rows); None when there are none."""
    counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
    row_slots = torch.repeat_interleave(seg.seg_slots, counts, output_size=seg.perm.shape[0])
    chosen = torch.isin(row_slots, torch.tensor(sorted(slots), dtype=row_slots.dtype))
    # int64 slots: what the rescale indexes with, converted once a step.
    return (seg.perm[chosen], row_slots[chosen].long()) if bool(chosen.any()) else None


class CpuDelta:
    """One group's fused LoRA delta in one step, for inputs ``[n_tokens, in]``: checked and planned
    (:meth:`prepare`), then :meth:`apply` per call. ``empty``: no row of the step uses a slot with a
    rank in this group, so there is nothing to apply."""

    __slots__ = (
        "a",
        "b",
        "dtype",
        "empty",
        "in_features",
        "meta",
        "n_tokens",
        "offsets",
        "out_total",
        "plan",
    )

    def __init__(
        self, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, plan: CpuOpPlan
    ) -> None:
        self.meta, self.a, self.b, self.plan = meta, a, b, plan
        self.offsets = [int(o) for o in meta.expand_layout()[1]]
        self.n_tokens, self.in_features, self.out_total = n_tokens, a.shape[2], b.shape[1]
        self.dtype = a.dtype
        self.empty = plan.empty

    @classmethod
    def prepare(
        cls, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, like: CpuDelta | None = None
    ) -> CpuDelta:
        """Checks and plans the delta of ``meta``'s segments over a group's ``a``
        ``[slots, n_slices * R, in]`` and ``b`` ``[slots, out_total, R]``, for ``n_tokens`` rows.

        ``like``: another group's delta of the same step; when made from the same segment arrays, for
        buffers of the same shapes, dtype and device, the same slice offsets and equal ranks, its checks
        and plan hold here too and are reused.

        Raises:
            OpArgumentError: everything :func:`lora_pin.ops.shrink` and :func:`~lora_pin.ops.expand`
                refuse (shapes, dtypes, devices, segment contents).
        """
        slot_scalings = meta.expand_layout()[0]
        if like is not None and _same_layout(like, meta, a, b, n_tokens):
            return cls(meta, a, b, n_tokens, like.plan)
        max_rank = check_shrink_args(stand_in(a, n_tokens, a.shape[2]), a, meta)
        check_expand_args(
            stand_in(b, n_tokens, b.shape[1]), stand_in(a, n_tokens, meta.n_slices * max_rank), b, meta
        )
        kernel = kernel_ok(a.dtype, a, b, slot_scalings)
        # From the cache of plans by content: the groups of a model mostly share their ranks, so one
        # plan (and one reading of the arrays) serves all of them in a step.
        return cls(meta, a, b, n_tokens, plan_for(meta, n_tokens, max_rank, a.dtype, kernel))

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out += delta(x)`` in place.

        Args:
            out: ``[n_tokens, out_total]`` of the pool's dtype, mutated; x: ``[n_tokens, in]``.

        Raises:
            OpArgumentError: ``x`` or ``out`` has another shape or dtype than the delta was prepared
                for, or requires grad with grad mode on.
        """
        if (
            x.dtype is not self.dtype
            or out.dtype is not self.dtype
            or x.shape != (self.n_tokens, self.in_features)
            or out.shape != (self.n_tokens, self.out_total)
        ):
            raise OpArgumentError(
                f"the LoRA delta was prepared for x {self.dtype} [{self.n_tokens}, {self.in_features}] and "
                f"out [{self.n_tokens}, {self.out_total}], got x {x.dtype} {tuple(x.shape)} and out "
                f"{out.dtype} {tuple(out.shape)}"
            )
        refuse_grad(out, x)
        meta = self.meta
        if self.plan.kernel is not None and not out.is_contiguous():
            # The native kernels write contiguous rows only: the op checks and plans this out in full.
            torch.ops.lora_pin.lora_delta_(out, x, self.a, self.b, *expand_args(meta))
            return
        assert meta.slot_scalings is not None
        delta_planned(out, x, self.a, self.b, meta.slot_scalings, self.offsets, self.plan)


def _same_layout(like: CpuDelta, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int) -> bool:
    """Whether ``like``'s checks and plan hold for ``meta`` over ``a`` and ``b``."""
    scalings, other_scalings = meta.slot_scalings, like.meta.slot_scalings
    return (
        n_tokens == like.n_tokens
        and meta.slice_offsets == like.meta.slice_offsets
        and same_tensor_kind(a, like.a)
        and same_tensor_kind(b, like.b)
        and scalings is not None
        and other_scalings is not None
        and same_tensor_kind(scalings, other_scalings)
        and same_segments(meta, like.meta)
    )


class CpuShrink:
    """One group's shrink in one step, for inputs ``[n_tokens, in]``, run apart from its expand (a
    fully sharded layer). ``empty``: no row uses a slot with a rank in ``meta``'s ranks (``v`` is zero)."""

    __slots__ = ("a", "dtype", "empty", "in_features", "meta", "n_tokens", "plan", "width")

    def __init__(self, meta: KernelMeta, a: torch.Tensor, n_tokens: int, plan: CpuOpPlan) -> None:
        self.meta, self.a, self.plan = meta, a, plan
        self.n_tokens, self.in_features, self.width, self.dtype = n_tokens, a.shape[2], a.shape[1], a.dtype
        self.empty = plan.empty

    @classmethod
    def prepare(
        cls, meta: KernelMeta, a: torch.Tensor, n_tokens: int, like: CpuShrink | None = None
    ) -> CpuShrink:
        """Checks and plans the shrink of ``meta``'s segments (with the ranks of ``a``'s rows: a fully
        sharded column layer's chunk) over ``a`` ``[slots, n_slices * R, in]``; ``like`` as for
        :meth:`CpuDelta.prepare`.

        Raises:
            OpArgumentError: everything :func:`lora_pin.ops.shrink` refuses.
        """
        if (
            like is not None
            and same_tensor_kind(a, like.a)
            and n_tokens == like.n_tokens
            and same_segments(meta, like.meta)
        ):
            return cls(meta, a, n_tokens, like.plan)
        max_rank = check_shrink_args(stand_in(a, n_tokens, a.shape[2]), a, meta)
        return cls(meta, a, n_tokens, plan_for(meta, n_tokens, max_rank, a.dtype, kernel_ok(a.dtype, a)))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``v[t] = x[t] @ A[slot(t)]ᵀ``: ``[n_tokens, n_slices * R]``, a new tensor (rows of no adapter
        and columns past each slice's rank zero).

        Raises:
            OpArgumentError: ``x`` has another shape or dtype than prepared for, or requires grad with
                grad mode on.
        """
        check_prepared_shrink("the LoRA shrink", self.dtype, self.n_tokens, self.in_features, x)
        if self.empty:
            return x.new_zeros(self.n_tokens, self.width)
        return shrink_planned(x, self.a, self.meta.n_slices, self.plan)


class CpuExpand:
    """One group's expand in one step, into outputs ``[n_tokens, out_total]``, run apart from its shrink.
    ``empty``: no row uses a slot with a rank in ``meta``'s ranks (given the group's full ranks, the same
    on every process of a tensor-parallel group)."""

    __slots__ = ("b", "dtype", "empty", "meta", "n_tokens", "offsets", "out_total", "plan")

    def __init__(self, meta: KernelMeta, b: torch.Tensor, n_tokens: int, plan: CpuOpPlan) -> None:
        self.meta, self.b, self.plan = meta, b, plan
        self.offsets = [int(o) for o in meta.expand_layout()[1]]
        self.n_tokens, self.out_total, self.dtype = n_tokens, b.shape[1], b.dtype
        self.empty = plan.empty

    @classmethod
    def prepare(
        cls, meta: KernelMeta, b: torch.Tensor, n_tokens: int, like: CpuExpand | None = None
    ) -> CpuExpand:
        """Checks and plans the expand of ``meta``'s segments over ``b`` ``[slots, out_total, R]``;
        ``like`` as for :meth:`CpuDelta.prepare`, when B's shape, the slice offsets and the scalings'
        kind match too.

        Raises:
            OpArgumentError: everything :func:`lora_pin.ops.expand` refuses.
        """
        slot_scalings, offsets = meta.expand_layout()
        if (
            like is not None
            and same_tensor_kind(b, like.b)
            and n_tokens == like.n_tokens
            and tuple(offsets) == tuple(like.offsets)
            and like.meta.slot_scalings is not None
            and same_tensor_kind(slot_scalings, like.meta.slot_scalings)
            and same_segments(meta, like.meta)
        ):
            return cls(meta, b, n_tokens, like.plan)
        max_rank = check_expand_args(
            stand_in(b, n_tokens, b.shape[1]), stand_in(b, n_tokens, meta.n_slices * b.shape[2]), b, meta
        )
        plan = plan_for(meta, n_tokens, max_rank, b.dtype, kernel_ok(b.dtype, b, slot_scalings))
        return cls(meta, b, n_tokens, plan)

    def apply(self, out: torch.Tensor, v: torch.Tensor) -> None:
        """``out += scaling * v B[slot]ᵀ`` per slice, in place. ``out`` may be a strided view (a row
        layer's column slice of its partial product): the native kernels then expand into a contiguous
        copy of it, copied back.

        Raises:
            OpArgumentError: ``out`` or ``v`` has another shape or dtype than prepared for, or requires
                grad with grad mode on.
        """
        width = self.b.shape[2] * self.meta.n_slices
        check_prepared_expand("the LoRA expand", self.dtype, self.n_tokens, self.out_total, width, out, v)
        if self.empty:
            return
        slot_scalings = self.meta.expand_layout()[0]
        if self.plan.kernel is not None and not out.is_contiguous():
            # The native kernels write contiguous rows only: they add into a copy of out, copied back (rows
            # of no adapter come back unchanged, bit for bit).
            scratch = out.contiguous()
            expand_planned(scratch, v, self.b, slot_scalings, self.offsets, self.plan)
            out.copy_(scratch)
            return
        expand_planned(out, v, self.b, slot_scalings, self.offsets, self.plan)


class CpuSplit(SplitDelta):
    """A group's :class:`CpuShrink` and :class:`CpuExpand` of one step, as a :class:`SplitDelta`."""

    __slots__ = ("expand_work", "shrink_work")

    def __init__(self, shrink_work: CpuShrink, expand_work: CpuExpand) -> None:
        self.shrink_work, self.expand_work = shrink_work, expand_work

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        return self.shrink_work.apply(x)

    def expand(self, out: torch.Tensor, v: torch.Tensor) -> None:
        self.expand_work.apply(out, v)


class CpuEmbeddingDelta:
    """One embedding group's LoRA delta in one step, for ``n_tokens`` ids. ``empty``: no row of the step
    uses an adapter with a rank in this group."""

    __slots__ = ("a", "b", "dim", "dtype", "empty", "meta", "n_tokens", "plan", "row_slots", "rows", "scale")

    def __init__(
        self, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, scale: float, plan: CpuOpPlan
    ) -> None:
        self.meta, self.a, self.b, self.plan = meta, a, b, plan
        self.n_tokens, self.dim, self.dtype, self.scale = n_tokens, b.shape[1], a.dtype, scale
        self.empty = plan.empty
        self.rows, self.row_slots = used_rows(meta)

    @classmethod
    def prepare(
        cls, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, scale: float = 1.0
    ) -> CpuEmbeddingDelta:
        """Checks and plans the delta of ``meta``'s segments (one slice ``(0, dim)``) over an embedding
        group's ``a`` ``[slots, R, num_embeddings]`` and ``b`` ``[slots, dim, R]``; ``scale``
        multiplies the looked-up columns (already rounded to the pool's dtype).

        Raises:
            OpArgumentError: what :func:`lora_pin.ops.embedding_delta_` refuses, but ids (not known yet).
        """
        slot_scalings = meta.expand_layout()[0]
        ids_like = torch.empty_strided((n_tokens,), (0,), dtype=torch.int64, device=b.device)
        check_embedding_args(stand_in(b, n_tokens, b.shape[1]), ids_like, a, b, meta)
        plan = plan_for(meta, n_tokens, b.shape[2], b.dtype, kernel_ok(b.dtype, b, slot_scalings))
        return cls(meta, a, b, n_tokens, scale, plan)

    def apply(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        """``out += delta(ids)`` in place.

        Args:
            out: ``[n_tokens, dim]`` of the pool's dtype, the base embeddings, mutated.
            ids: int64 ``[n_tokens]``, the ids the base embedding looked up (so within its vocabulary).

        Raises:
            OpArgumentError: ``out`` or ``ids`` has another shape or dtype than prepared for, or ``out``
                requires grad with grad mode on.
        """
        if (
            out.dtype is not self.dtype
            or ids.dtype is not torch.int64
            or ids.shape != (self.n_tokens,)
            or out.shape != (self.n_tokens, self.dim)
        ):
            raise OpArgumentError(
                f"the embedding's LoRA delta was prepared for ids int64 [{self.n_tokens}] and out "
                f"{self.dtype} [{self.n_tokens}, {self.dim}], got ids {ids.dtype} {tuple(ids.shape)} and out "
                f"{out.dtype} {tuple(out.shape)}"
            )
        refuse_grad(out)
        meta = self.meta
        if self.plan.kernel is not None and not out.is_contiguous():
            # The native kernels write contiguous rows only: the op checks and plans this out in full.
            torch.ops.lora_pin.embedding_delta_(out, ids, self.a, self.b, *expand_args(meta), self.scale)
            return
        if not self.empty:
            assert meta.slot_scalings is not None
            lookup_expand(
                out, ids, self.a, self.b, meta.slot_scalings, self.rows, self.row_slots, self.scale, self.plan
            )
