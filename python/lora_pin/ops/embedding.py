"""An embedding layer's LoRA delta for one step, checked and planned once: ``lora_pin::embedding_delta_``.

PEFT's embedding LoRA adds ``scaling * B[slot] A[slot][:, id]`` to each adapter token's embedding: the
shrink of a linear becomes a lookup of one column of the slot's A per token, and the expand is the
linear's. On the CPU, :func:`prepare_embedding_delta` checks the step's segments against a group's
buffers, plans the expand and reads which rows use a slot with a rank in the group, once per step; a
call is then one ``lora_pin::embedding_delta_`` dispatch, the lookup and the expand. A group that no
row of the step uses has nothing to call (:attr:`PreparedEmbeddingDelta.empty`).

As for :mod:`lora_pin.ops.prepared`, the op takes the prepared plan by its handle only for the very
tensors it was made from; any other call (a direct one, ``opcheck``) checks and plans in full. The op
has a CPU kernel and a fake one: on a device, :class:`lora_pin.model.layers.LoRAEmbedding` gathers the
columns itself and calls ``lora_pin::expand``, which never reads the segment arrays on the host.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import check_expand_args, check_expand_memory, refuse_grad
from lora_pin.ops.grouped import Plan, expand_planned, kernel_ok, plan_for
from lora_pin.ops.segments import KernelMeta

__all__ = ["PreparedEmbeddingDelta", "embedding_delta_", "prepare_embedding_delta"]

# Handle -> prepared embedding delta, alive while its step holds it.
_BY_HANDLE: weakref.WeakValueDictionary[int, PreparedEmbeddingDelta] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _meta(
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    dim: int,
) -> KernelMeta:
    return KernelMeta(perm, seg_indptr, seg_slots, slot_ranks, 1, slot_scalings, (0, dim))


def _check(
    out: torch.Tensor,  # [T, dim]
    ids: torch.Tensor,  # int64 [T]
    a: torch.Tensor,  # [slots, R, num_embeddings]
    b: torch.Tensor,  # [slots, dim, R]
    meta: KernelMeta,
) -> None:
    """The shapes, dtypes and devices of the op's arguments (no contents read).

    Raises:
        OpArgumentError: naming the first argument that does not fit.
    """
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.shape[0] != out.shape[0] or ids.device != out.device:
        raise OpArgumentError(
            f"ids must be int64 [T={out.shape[0]}] on {out.device}, got {tuple(ids.shape)} {ids.dtype} "
            f"on {ids.device}"
        )
    if a.dim() != 3 or a.dtype != out.dtype or a.device != out.device or a.shape[0] != b.shape[0]:
        raise OpArgumentError(
            f"a must be {out.dtype} [slots={b.shape[0]}, R, num_embeddings] on {out.device}, got "
            f"{tuple(a.shape)} {a.dtype} on {a.device}"
        )
    if a.shape[1] != b.shape[2]:
        raise OpArgumentError(
            f"a has rank {a.shape[1]} but b has rank {b.shape[2]}: {tuple(a.shape)}, {tuple(b.shape)}"
        )
    # v stands for the looked-up columns: one element stands for the whole tensor.
    check_expand_args(out, out.new_empty_strided((out.shape[0], a.shape[1]), (0, 0)), b, meta)


def _used_rows(meta: KernelMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``meta``'s segments whose slot has a rank in the group, and their slots (int64
    ``[M]`` each): the only rows whose A columns the expand reads."""
    counts = (meta.seg_indptr[1:] - meta.seg_indptr[:-1]).long()
    row_slots = torch.repeat_interleave(meta.seg_slots.long(), counts, output_size=meta.perm.shape[0])
    # A rank of 0 appended, which slot -1 (a segment without adapter) reads.
    ranks = torch.cat([meta.slot_ranks[:, 0], meta.slot_ranks.new_zeros(1)])
    used = ranks[row_slots] > 0
    return meta.perm[used], row_slots[used]


def _lookup_expand(
    out: torch.Tensor,  # [T, dim], updated in place
    ids: torch.Tensor,  # int64 [T]
    a: torch.Tensor,  # [slots, R, num_embeddings]
    b: torch.Tensor,  # [slots, dim, R]
    slot_scalings: torch.Tensor,  # float32 [slots, 1]
    rows: torch.Tensor,  # int64 [M]
    row_slots: torch.Tensor,  # int64 [M]
    scale: float,
    plan: Plan,
) -> None:
    looked_up = a[row_slots, :, ids.index_select(0, rows)]  # [M, R]
    if scale != 1.0:
        looked_up = looked_up * scale
    v = out.new_zeros(out.shape[0], a.shape[1])
    v.index_copy_(0, rows, looked_up)
    expand_planned(out, v, b, slot_scalings, (0, out.shape[1]), plan)


class PreparedEmbeddingDelta:
    """The LoRA delta of one embedding group in one step, for ``n_tokens`` ids (see the module).

    Made by :func:`prepare_embedding_delta`; :meth:`apply` adds the delta to the embedding's output.
    ``empty``: no row of the step uses an adapter with a rank in this group, so there is nothing to apply.
    """

    __slots__ = (
        "__weakref__",
        "a",
        "b",
        "dim",
        "dtype",
        "empty",
        "handle",
        "meta",
        "n_tokens",
        "plan",
        "row_slots",
        "rows",
        "scale",
    )

    def __init__(
        self, meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, scale: float, plan: Plan
    ) -> None:
        self.meta, self.a, self.b, self.plan = meta, a, b, plan
        self.n_tokens, self.dim, self.dtype, self.scale = n_tokens, b.shape[1], a.dtype, scale
        self.empty = plan.empty
        self.rows, self.row_slots = _used_rows(meta)
        self.handle = next(_HANDLES)
        _BY_HANDLE[self.handle] = self

    def apply(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        """``out += delta(ids)`` in place, through ``lora_pin::embedding_delta_`` with the prepared plan.

        Args:
            out: ``[n_tokens, dim]`` of the pool's dtype, the base embeddings, mutated.
            ids: int64 ``[n_tokens]``, the token ids the base embedding looked up (so within its vocabulary).

        Raises:
            OpArgumentError: ``out`` or ``ids`` has another shape or dtype than the delta was prepared
                for, or ``out`` requires grad with grad mode on.
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
        assert meta.slot_scalings is not None
        torch.ops.lora_pin.embedding_delta_(
            out,
            ids,
            self.a,
            self.b,
            meta.perm,
            meta.seg_indptr,
            meta.seg_slots,
            meta.slot_ranks,
            meta.slot_scalings,
            self.scale,
            self.handle,
        )


def prepare_embedding_delta(
    meta: KernelMeta, a: torch.Tensor, b: torch.Tensor, n_tokens: int, scale: float = 1.0
) -> PreparedEmbeddingDelta:
    """Checks and plans an embedding group's LoRA delta over ``meta``'s segments, for ``n_tokens`` ids on
    the CPU.

    Args:
        meta: the step's segments in this group with its scalings, one slice ``(0, dim)``
            (:meth:`KernelMeta.for_layer`).
        a: ``[slots, R, num_embeddings]``, the group's stacked A (PEFT's ``lora_embedding_A`` per slot);
            b: ``[slots, dim, R]``, its B.
        n_tokens: ``T``, the ids of each call.
        scale: multiplies the looked-up columns (a scaled embedding's ``embed_scale``, as PEFT applies
            it to the delta), already rounded to the pool's dtype.

    Raises:
        OpArgumentError: a shape, dtype or device that does not fit, ``meta`` with more than one slice,
            or segment contents :func:`lora_pin.ops.expand` refuses (checked here once, not per call).
    """
    slot_scalings, offsets = meta.expand_layout()
    if meta.n_slices != 1 or len(offsets) != 2:
        raise OpArgumentError(f"an embedding group has one slice, got slice_offsets {list(offsets)}")
    out_like = b.new_empty_strided((n_tokens, b.shape[1]), (0, 0))
    _check(out_like, torch.empty_strided((n_tokens,), (0,), dtype=torch.int64, device=b.device), a, b, meta)
    kernel = kernel_ok(b.dtype, b, slot_scalings)
    return PreparedEmbeddingDelta(
        meta, a, b, n_tokens, scale, plan_for(meta, n_tokens, b.shape[2], b.dtype, kernel)
    )


def _prepared(
    handle: int,
    out: torch.Tensor,
    ids: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    arrays: tuple[torch.Tensor, ...],
    scale: float,
) -> PreparedEmbeddingDelta | None:
    """The delta prepared under ``handle`` if it was made for exactly these tensors; None otherwise."""
    prepared = _BY_HANDLE.get(handle) if handle >= 0 else None
    if prepared is None or a is not prepared.a or b is not prepared.b or scale != prepared.scale:
        return None
    meta = prepared.meta
    if any(t is not m for t, m in zip(arrays, (*meta[:4], meta.slot_scalings), strict=True)):
        return None
    if ids.shape != (prepared.n_tokens,) or out.shape != (prepared.n_tokens, prepared.dim):
        return None
    if ids.dtype is not torch.int64 or out.dtype is not prepared.dtype:
        return None
    if prepared.plan.kernel is not None and not out.is_contiguous():
        return None
    return prepared


torch.library.define(
    "lora_pin::embedding_delta_",
    "(Tensor(a!) out, Tensor ids, Tensor a, Tensor b, Tensor perm, Tensor seg_indptr, Tensor seg_slots, "
    "Tensor slot_ranks, Tensor slot_scalings, float scale=1.0, int prepared=-1) -> ()",
)


@torch.library.impl("lora_pin::embedding_delta_", "cpu")
def _embedding_delta_cpu(
    out: torch.Tensor,
    ids: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    scale: float = 1.0,
    prepared: int = -1,
) -> None:
    arrays = (perm, seg_indptr, seg_slots, slot_ranks, slot_scalings)
    found = _prepared(prepared, out, ids, a, b, arrays, scale)
    if found is not None:
        plan, rows, row_slots = found.plan, found.rows, found.row_slots
    else:
        meta = _meta(*arrays, out.shape[1])
        _check(out, ids, a, b, meta)
        check_expand_memory(out, ids=ids, a=a, b=b, slot_scalings=slot_scalings)
        plan = plan_for(
            meta, out.shape[0], b.shape[2], out.dtype, kernel_ok(out.dtype, out, b, slot_scalings)
        )
        rows, row_slots = _used_rows(meta)
        if rows.numel():
            lowest, highest = torch.aminmax(ids.index_select(0, rows))
            if int(lowest) < 0 or int(highest) >= a.shape[2]:
                raise OpArgumentError(
                    f"ids holds {int(lowest)}..{int(highest)} outside the embedding's [0, {a.shape[2]})"
                )
    if not plan.empty:
        _lookup_expand(out, ids, a, b, slot_scalings, rows, row_slots, scale, plan)


@torch.library.register_fake("lora_pin::embedding_delta_")
def _embedding_delta_fake(
    out: torch.Tensor,
    ids: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    scale: float = 1.0,
    prepared: int = -1,
) -> None:
    _check(out, ids, a, b, _meta(perm, seg_indptr, seg_slots, slot_ranks, slot_scalings, out.shape[1]))


def embedding_delta_(
    out: torch.Tensor,
    ids: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    meta: KernelMeta,
    scale: float = 1.0,
) -> torch.Tensor:
    """Adds every adapter token's embedding LoRA delta to ``out`` in place, on the CPU:
    ``out[t] += scaling[slot] * scale * B[slot][:, :rank] @ A[slot][:rank, ids[t]]``; rows of no adapter,
    or of an adapter without a rank in this group, are left bit for bit.

    Args:
        out: ``[T, dim]`` fp16/bf16/fp32, the base embeddings, mutated.
        ids: int64 ``[T]``, the token ids.
        a: ``[slots, R, num_embeddings]``; b: ``[slots, dim, R]``; both of ``out``'s dtype.
        meta: the step's segments with the group's ranks, scalings and one slice ``(0, dim)``.
        scale: multiplies the looked-up columns (a scaled embedding's ``embed_scale``).

    Returns ``out``. One call checks everything; a step that runs many calls prepares them once
    (:func:`prepare_embedding_delta`).

    Raises:
        OpArgumentError: a shape, dtype or device that does not fit, an id outside the embedding, segment
            contents :func:`lora_pin.ops.expand` refuses, or ``out`` requires grad with grad mode on.
    """
    if torch.is_grad_enabled() and out.requires_grad:
        raise OpArgumentError(
            "lora_pin ops have no autograd formula; run them under torch.inference_mode() or torch.no_grad()"
        )
    slot_scalings, offsets = meta.expand_layout()
    if meta.n_slices != 1 or len(offsets) != 2:
        raise OpArgumentError(f"an embedding group has one slice, got slice_offsets {list(offsets)}")
    torch.ops.lora_pin.embedding_delta_(out, ids, a, b, *meta[:4], slot_scalings, scale)
    return out
