"""A layer group's shrink and expand for one step, checked and planned once but run apart:
:class:`PreparedShrink` and :class:`PreparedExpand`, through ``lora_pin::prepared_shrink`` and
``lora_pin::prepared_expand_``.

A fully sharded tensor-parallel layer cannot take the fused ``lora_pin::lora_delta_``
(:mod:`lora_pin.ops.prepared`): a collective sits between its shrink and its expand (an all-gather of
the rank chunks for a column layer, an all-reduce of the partial ``[T, R]`` for a row layer). What the
ops would check and plan on every call is done once per step instead, by :func:`prepare_shrink` and
:func:`prepare_expand`; a call then costs a few shape checks, one dispatch per op and the kernels.

The shrink may run with other ranks than the expand (a column layer's chunk of the rank dimension),
so each has its own plan. A prepared expand's ``empty`` is read from the ranks it was prepared with:
given the group's full ranks (the same on every process of a tensor-parallel group) it says the same
on every process, so all of them skip a layer's collective together or none does.

Each op finds its plan by the handle it is given and uses it only for the very tensors it was made
from (identity, as for :mod:`lora_pin.ops.prepared`); any other call checks and plans in full, so the
ops stay correct when called directly or checked by ``opcheck``. They have CPU kernels and fake ones;
on a device a layer calls the checked ``lora_pin::shrink`` and ``lora_pin::expand``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import (
    check_expand_args,
    check_expand_memory,
    check_shrink_args,
    refuse_grad,
    same_tensor_kind,
)
from lora_pin.ops.grouped import Plan, expand_planned, kernel_ok, plan_for, shrink_planned
from lora_pin.ops.segments import KernelMeta, expand_meta, same_segments, shrink_meta

__all__ = ["PreparedExpand", "PreparedShrink", "prepare_expand", "prepare_shrink"]

# Handle -> prepared shrink or expand, alive while its step holds it.
_BY_HANDLE: weakref.WeakValueDictionary[int, PreparedShrink | PreparedExpand] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class PreparedShrink:
    """The shrink of one layer group in one step, for inputs ``[n_tokens, in]`` (see the module).

    Made by :func:`prepare_shrink`; :meth:`apply` returns ``v``. ``empty``: no row of the step uses a
    slot with a rank in ``meta``'s ranks, so ``v`` is all zeros (and :meth:`apply` calls no op).
    """

    __slots__ = (
        "__weakref__",
        "a",
        "dtype",
        "empty",
        "handle",
        "in_features",
        "meta",
        "n_tokens",
        "plan",
        "width",
    )

    def __init__(self, meta: KernelMeta, a: torch.Tensor, n_tokens: int, plan: Plan) -> None:
        self.meta, self.a, self.plan = meta, a, plan
        self.n_tokens, self.in_features, self.width, self.dtype = n_tokens, a.shape[2], a.shape[1], a.dtype
        self.empty = plan.empty
        self.handle = next(_HANDLES)
        _BY_HANDLE[self.handle] = self

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``v[t] = x[t] @ A[slot(t)]ᵀ`` as :func:`lora_pin.ops.shrink` with the prepared meta.

        Args:
            x: ``[n_tokens, in]`` of the pool's dtype.

        Returns:
            ``v``: ``[n_tokens, n_slices * R]`` (``R`` of the A it was prepared over), a new tensor;
            rows of no adapter and columns past each slice's rank are zero.

        Raises:
            OpArgumentError: ``x`` has another shape or dtype than the shrink was prepared for, or
                requires grad with grad mode on.
        """
        if x.dtype is not self.dtype or x.shape != (self.n_tokens, self.in_features):
            raise OpArgumentError(
                f"the LoRA shrink was prepared for x {self.dtype} [{self.n_tokens}, {self.in_features}], "
                f"got x {x.dtype} {tuple(x.shape)}"
            )
        refuse_grad(x)
        if self.empty:
            return x.new_zeros(self.n_tokens, self.width)
        meta = self.meta
        return torch.ops.lora_pin.prepared_shrink(
            x, self.a, meta.perm, meta.seg_indptr, meta.seg_slots, meta.slot_ranks, meta.n_slices, self.handle
        )


class PreparedExpand:
    """The expand of one layer group in one step, into outputs ``[n_tokens, out_total]`` (see the
    module).

    Made by :func:`prepare_expand`; :meth:`apply` adds the scaled products to ``out``. ``empty``: no
    row of the step uses a slot with a rank in ``meta``'s ranks, so there is nothing to apply.
    """

    __slots__ = (
        "__weakref__",
        "b",
        "dtype",
        "empty",
        "handle",
        "meta",
        "n_tokens",
        "offsets",
        "out_total",
        "plan",
    )

    def __init__(self, meta: KernelMeta, b: torch.Tensor, n_tokens: int, plan: Plan) -> None:
        self.meta, self.b, self.plan = meta, b, plan
        self.offsets = [int(o) for o in meta.expand_layout()[1]]
        self.n_tokens, self.out_total, self.dtype = n_tokens, b.shape[1], b.dtype
        self.empty = plan.empty
        self.handle = next(_HANDLES)
        _BY_HANDLE[self.handle] = self

    def apply(self, out: torch.Tensor, v: torch.Tensor) -> None:
        """``out += scaling * v B[slot]ᵀ`` per slice, in place, as :func:`lora_pin.ops.expand` with the
        prepared meta. ``out`` may be a strided view (a row layer's column slice of its partial
        product): the native kernels then expand into a contiguous copy of it, copied back.

        Args:
            out: ``[n_tokens, out_total]`` of the pool's dtype, mutated; rows of no adapter keep their
                values bit for bit.
            v: ``[n_tokens, n_slices * R]`` (``R`` of the B it was prepared over), of the pool's dtype.

        Raises:
            OpArgumentError: ``out`` or ``v`` has another shape or dtype than the expand was prepared
                for, or requires grad with grad mode on.
        """
        width = self.b.shape[2] * self.meta.n_slices
        if (
            out.dtype is not self.dtype
            or v.dtype is not self.dtype
            or out.shape != (self.n_tokens, self.out_total)
            or v.shape != (self.n_tokens, width)
        ):
            raise OpArgumentError(
                f"the LoRA expand was prepared for out {self.dtype} [{self.n_tokens}, {self.out_total}] and "
                f"v [{self.n_tokens}, {width}], got out {out.dtype} {tuple(out.shape)} and v {v.dtype} "
                f"{tuple(v.shape)}"
            )
        refuse_grad(out, v)
        if self.empty:
            return
        meta = self.meta
        torch.ops.lora_pin.prepared_expand_(
            out,
            v,
            self.b,
            meta.perm,
            meta.seg_indptr,
            meta.seg_slots,
            meta.slot_ranks,
            meta.slot_scalings,
            self.offsets,
            self.handle,
        )


def prepare_shrink(
    meta: KernelMeta, a: torch.Tensor, n_tokens: int, like: PreparedShrink | None = None
) -> PreparedShrink:
    """Checks and plans the shrink of ``meta``'s segments over a pool group's ``a``, for CPU inputs of
    ``n_tokens`` rows.

    Args:
        meta: the step's segments with the ranks of ``a``'s rows (scalings and offsets not read).
        a: ``[slots, n_slices * R, in]``, the group's stacked A (a fully sharded column layer's: this
            process's chunk of each slice's rank dimension, with ``meta`` holding each slot's rows of it).
        n_tokens: ``T``, the rows of the layer inputs.
        like: the prepared shrink of another group of the same step: when made from the same segment
            arrays over an A of the same shape, dtype and device, with equal ranks, its checks and plan
            hold here too and are reused; otherwise everything is checked and planned.

    Raises:
        OpArgumentError: everything :func:`lora_pin.ops.shrink` refuses, checked here once.
    """
    if (
        like is not None
        and same_tensor_kind(a, like.a)
        and n_tokens == like.n_tokens
        and same_segments(meta, like.meta)
    ):
        return PreparedShrink(meta, a, n_tokens, like.plan)
    max_rank = check_shrink_args(a.new_empty_strided((n_tokens, a.shape[2]), (0, 0)), a, meta)
    plan = plan_for(meta, n_tokens, max_rank, a.dtype, kernel_ok(a.dtype, a))
    return PreparedShrink(meta, a, n_tokens, plan)


def prepare_expand(
    meta: KernelMeta, b: torch.Tensor, n_tokens: int, like: PreparedExpand | None = None
) -> PreparedExpand:
    """Checks and plans the expand of ``meta``'s segments over a pool group's ``b``, for CPU outputs of
    ``n_tokens`` rows.

    Args:
        meta: the step's segments with the group's ranks, scalings and slice offsets (these ranks decide
            ``empty``: give the full ones, the same on every process, for a layer with a collective).
        b: ``[slots, out_total, R]``, the group's stacked B.
        n_tokens: ``T``, the rows of the layer outputs.
        like: the prepared expand of another group of the same step: reused as for
            :func:`prepare_shrink` when B's shape, the slice offsets and the scalings' kind match too.

    Raises:
        OpArgumentError: everything :func:`lora_pin.ops.expand` refuses, checked here once.
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
        return PreparedExpand(meta, b, n_tokens, like.plan)
    out_like = b.new_empty_strided((n_tokens, b.shape[1]), (0, 0))
    v_like = b.new_empty_strided((n_tokens, meta.n_slices * b.shape[2]), (0, 0))
    max_rank = check_expand_args(out_like, v_like, b, meta)
    plan = plan_for(meta, n_tokens, max_rank, b.dtype, kernel_ok(b.dtype, b, slot_scalings))
    return PreparedExpand(meta, b, n_tokens, plan)


def _shrink_plan(
    handle: int,
    x: torch.Tensor,
    a: torch.Tensor,
    arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    n_slices: int,
) -> Plan | None:
    """The plan of the shrink prepared under ``handle`` if it was made for exactly these tensors; None
    otherwise, and the caller checks and plans in full."""
    found = _BY_HANDLE.get(handle) if handle >= 0 else None
    if type(found) is not PreparedShrink or a is not found.a:
        return None
    meta = found.meta
    perm, seg_indptr, seg_slots, slot_ranks = arrays
    if (
        perm is not meta.perm
        or seg_indptr is not meta.seg_indptr
        or seg_slots is not meta.seg_slots
        or slot_ranks is not meta.slot_ranks
        or n_slices != meta.n_slices
        or x.dtype is not found.dtype
        or x.shape != (found.n_tokens, found.in_features)
    ):
        return None
    return found.plan


def _expand_plan(
    handle: int,
    out: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    slice_offsets: list[int],
) -> Plan | None:
    """As :func:`_shrink_plan`, for the expand prepared under ``handle``."""
    found = _BY_HANDLE.get(handle) if handle >= 0 else None
    if type(found) is not PreparedExpand or b is not found.b:
        return None
    meta = found.meta
    perm, seg_indptr, seg_slots, slot_ranks, slot_scalings = arrays
    if (
        perm is not meta.perm
        or seg_indptr is not meta.seg_indptr
        or seg_slots is not meta.seg_slots
        or slot_ranks is not meta.slot_ranks
        or slot_scalings is not meta.slot_scalings
        or slice_offsets != found.offsets
        or out.dtype is not found.dtype
        or v.dtype is not found.dtype
        or out.shape != (found.n_tokens, found.out_total)
        or v.shape != (found.n_tokens, meta.n_slices * b.shape[2])
    ):
        return None
    return found.plan


torch.library.define(
    "lora_pin::prepared_shrink",
    "(Tensor x, Tensor a, Tensor perm, Tensor seg_indptr, Tensor seg_slots, Tensor slot_ranks, int n_slices, "
    "int prepared=-1) -> Tensor",
)


@torch.library.impl("lora_pin::prepared_shrink", "cpu")
def _prepared_shrink_cpu(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
    prepared: int = -1,
) -> torch.Tensor:
    plan = _shrink_plan(prepared, x, a, (perm, seg_indptr, seg_slots, slot_ranks), n_slices)
    if plan is None:
        meta = shrink_meta(perm, seg_indptr, seg_slots, slot_ranks, n_slices)
        max_rank = check_shrink_args(x, a, meta)
        plan = plan_for(meta, x.shape[0], max_rank, x.dtype, kernel_ok(x.dtype, a))
    return shrink_planned(x, a, n_slices, plan)


@torch.library.register_fake("lora_pin::prepared_shrink")
def _prepared_shrink_fake(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
    prepared: int = -1,
) -> torch.Tensor:
    max_rank = check_shrink_args(x, a, shrink_meta(perm, seg_indptr, seg_slots, slot_ranks, n_slices))
    return x.new_empty(x.shape[0], n_slices * max_rank)


torch.library.define(
    "lora_pin::prepared_expand_",
    "(Tensor(a!) out, Tensor v, Tensor b, Tensor perm, Tensor seg_indptr, Tensor seg_slots, "
    "Tensor slot_ranks, Tensor slot_scalings, int[] slice_offsets, int prepared=-1) -> ()",
)


@torch.library.impl("lora_pin::prepared_expand_", "cpu")
def _prepared_expand_cpu(
    out: torch.Tensor,
    v: torch.Tensor,
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
    plan = _expand_plan(prepared, out, v, b, arrays, slice_offsets)
    if plan is None:
        meta = expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
        max_rank = check_expand_args(out, v, b, meta)
        check_expand_memory(out, v=v, b=b, slot_scalings=slot_scalings)
        plan = plan_for(meta, out.shape[0], max_rank, out.dtype, kernel_ok(out.dtype, out, b, slot_scalings))
    if plan.kernel is not None and not out.is_contiguous():
        # The native kernels write contiguous rows only: they add into a copy of out, copied back (rows
        # of no adapter come back unchanged, bit for bit).
        scratch = out.contiguous()
        expand_planned(scratch, v, b, slot_scalings, slice_offsets, plan)
        out.copy_(scratch)
        return
    expand_planned(out, v, b, slot_scalings, slice_offsets, plan)


@torch.library.register_fake("lora_pin::prepared_expand_")
def _prepared_expand_fake(
    out: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: list[int],
    prepared: int = -1,
) -> None:
    check_expand_args(
        out, v, b, expand_meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, slice_offsets)
    )
