"""One layer group's LoRA delta for one step, checked and planned once: :class:`PreparedDelta`.

Every layer of a group runs the same segments over the same pool buffers in a step, so what the ops
would check and plan on every call (the segment arrays' shapes and contents, the pool's shapes, which
rows go to the native kernels, to batched GEMMs, to views or to a gathered block) is done once, by
:func:`prepare_delta`. A call then costs a few shape checks, one ``lora_pin::lora_delta_`` dispatch and
the kernels; a group that no row of the step uses has nothing to call (:attr:`PreparedDelta.empty`).

The op finds the plan by the handle it is given and uses it only for the very tensors it was made
from (identity, not contents: a step's arrays are never refilled while the step runs, and the plan
holds them, so no other tensor can take their place); any other call re-checks and re-plans as the
plain ops do, so the op stays correct when called directly, traced or checked by ``opcheck``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import check_expand_args, check_shrink_args, refuse_grad, same_tensor_kind
from lora_pin.ops.grouped import Plan, kernel_ok, plan_for
from lora_pin.ops.segments import KernelMeta, same_segments

__all__ = ["PreparedDelta", "prepare_delta", "prepared_plan"]

# Handle -> prepared delta, alive while its step holds it.
_BY_HANDLE: weakref.WeakValueDictionary[int, PreparedDelta] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class PreparedDelta:
    """The LoRA delta of one layer group in one step, for inputs ``[n_tokens, in]`` (see the module).

    Made by :func:`prepare_delta`; :meth:`apply` adds the delta to a layer's output. ``empty``: no row of
    the step uses an adapter with a rank in this group, so there is nothing to apply.
    """

    __slots__ = (
        "__weakref__",
        "a",
        "b",
        "dtype",
        "empty",
        "handle",
        "in_features",
        "meta",
        "n_tokens",
        "offsets",
        "out_total",
        "plan",
    )

    def __init__(self, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, plan: Plan) -> None:
        self.meta = meta
        self.offsets = [int(o) for o in meta.expand_layout()[1]]
        self.a, self.b = a, b
        self.n_tokens, self.in_features, self.out_total = n_tokens, a.shape[2], b.shape[1]
        self.dtype = a.dtype
        self.plan = plan
        # No row of the step uses an adapter with a rank in this group: apply has nothing to do.
        self.empty = plan.empty
        self.handle = next(_HANDLES)
        _BY_HANDLE[self.handle] = self

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out += delta(x)`` in place, as :func:`lora_pin.ops.lora_delta_` with the prepared meta.

        Args:
            out: ``[n_tokens, out_total]`` of the pool's dtype, mutated.
            x: ``[n_tokens, in]`` of the pool's dtype.

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
        torch.ops.lora_pin.lora_delta_(
            out,
            x,
            self.a,
            self.b,
            meta.perm,
            meta.seg_indptr,
            meta.seg_slots,
            meta.slot_ranks,
            meta.slot_scalings,
            self.offsets,
            self.handle,
        )


def prepare_delta(
    meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, like: PreparedDelta | None = None
) -> PreparedDelta:
    """Checks and plans the LoRA delta of ``meta``'s segments over a pool group's ``a`` and ``b``, for
    CPU inputs of ``n_tokens`` rows.

    Args:
        meta: the step's segments in this group, with scalings and slice offsets
            (:meth:`KernelMeta.for_layer`).
        a: ``[slots, n_slices * R, in]``, the group's stacked A; b: ``[slots, out_total, R]``, its B.
        n_tokens: ``T``, the rows of the layer inputs the delta will be applied to.
        like: the prepared delta of another group of the same step: when it was made from the same
            segment arrays, for buffers of the same shapes, dtype and device, the same slice offsets and
            equal ranks, its checks and plan hold for this group too and are reused (the layers of a
            model are called once each per step, so the work done once per step must be shared among
            them); otherwise everything is checked and planned.

    Raises:
        OpArgumentError: everything :func:`lora_pin.ops.shrink` and :func:`~lora_pin.ops.expand` refuse
            (shapes, dtypes, devices, segment contents), checked here once instead of on every call.
    """
    slot_scalings = meta.expand_layout()[0]
    if like is not None and _same_layout(like, meta, a, b, n_tokens):
        return PreparedDelta(meta, a, b, n_tokens, like.plan)

    def like(t: torch.Tensor, columns: int) -> torch.Tensor:
        # The checks read shapes, dtypes and devices only: one element stands for the whole tensor.
        return t.new_empty_strided((n_tokens, columns), (0, 0))

    max_rank = check_shrink_args(like(a, a.shape[2]), a, meta)
    check_expand_args(like(b, b.shape[1]), like(a, meta.n_slices * max_rank), b, meta)
    kernel = kernel_ok(a.dtype, a, b, slot_scalings)
    # From the cache of plans by content: the layer groups of a model mostly share their ranks, so one
    # plan (and one reading of the arrays) serves all of them in a step.
    return PreparedDelta(meta, a, b, n_tokens, plan_for(meta, n_tokens, max_rank, a.dtype, kernel))


def _same_layout(
    like: PreparedDelta, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int
) -> bool:
    """Whether ``like``'s checks and plan hold for ``meta`` over ``a`` and ``b`` (:func:`prepare_delta`)."""
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


def prepared_plan(
    handle: int,
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    segment_arrays: tuple[torch.Tensor, ...],
) -> Plan | None:
    """The plan prepared under ``handle`` if it was made for exactly these tensors (and the kernels can
    read ``out`` in place); None otherwise, and the caller checks and plans in full."""
    prepared = _BY_HANDLE.get(handle) if handle >= 0 else None
    if prepared is None or a is not prepared.a or b is not prepared.b:
        return None
    meta = prepared.meta
    perm, seg_indptr, seg_slots, slot_ranks, slot_scalings = segment_arrays
    if (
        perm is not meta.perm
        or seg_indptr is not meta.seg_indptr
        or seg_slots is not meta.seg_slots
        or slot_ranks is not meta.slot_ranks
        or slot_scalings is not meta.slot_scalings
    ):
        return None
    if x.shape != (prepared.n_tokens, prepared.in_features) or out.shape != (
        prepared.n_tokens,
        prepared.out_total,
    ):
        return None
    if x.dtype is not prepared.dtype or out.dtype is not prepared.dtype:
        return None
    if prepared.plan.kernel is not None and not out.is_contiguous():
        return None
    return prepared.plan
