"""An embedding layer's LoRA delta: ``lora_pin::embedding_delta_``, its CPU and fake bodies and its face.

PEFT's embedding LoRA adds ``scaling * B[slot] A[slot][:, id]`` to each adapter token's embedding: the
shrink of a linear becomes a lookup of one column of the slot's A per token, and the expand is the
linear's. The op checks the step's segments against a group's buffers, plans the expand and reads which
rows use a slot with a rank in the group on every call; the LoRA layers on the CPU do that once per
step and group instead (:class:`lora_pin.ops.backends.CpuBackend`, with the helpers here). The op has a
CPU body and a fake one: on a device the layers gather the columns themselves and call
``lora_pin::expand``, which never reads the segment arrays on the host.
"""

from __future__ import annotations

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import check_expand_args, check_expand_memory, refuse_grad
from lora_pin.ops.custom_ops import expand_args
from lora_pin.ops.grouped import CpuOpPlan, expand_planned, kernel_ok, plan_for
from lora_pin.ops.segments import KernelMeta

__all__ = ["check_embedding_args", "embedding_delta_", "lookup_expand", "used_rows"]


def check_embedding_args(
    out: torch.Tensor,  # [T, dim]
    ids: torch.Tensor,  # int64 [T]
    a: torch.Tensor,  # [slots, R, num_embeddings]
    b: torch.Tensor,  # [slots, dim, R]
    meta: KernelMeta,
) -> None:
    """The shapes, dtypes and devices of the op's arguments (no contents read).

    Raises:
        OpArgumentError: naming the first argument that does not fit, or ``meta`` with more than one slice.
    """
    offsets = meta.expand_layout()[1]
    if meta.n_slices != 1 or len(offsets) != 2:
        raise OpArgumentError(f"an embedding group has one slice, got slice_offsets {list(offsets)}")
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


def used_rows(meta: KernelMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``meta``'s segments whose slot has a rank in the group, and their slots (int64
    ``[M]`` each): the only rows whose A columns the expand reads."""
    counts = (meta.seg_indptr[1:] - meta.seg_indptr[:-1]).long()
    row_slots = torch.repeat_interleave(meta.seg_slots.long(), counts, output_size=meta.perm.shape[0])
    # A rank of 0 appended, which slot -1 (a segment without adapter) reads.
    ranks = torch.cat([meta.ranks()[:, 0], meta.ranks().new_zeros(1)])
    used = ranks[row_slots] > 0
    return meta.perm[used], row_slots[used]


def lookup_expand(
    out: torch.Tensor,  # [T, dim], updated in place
    ids: torch.Tensor,  # int64 [T]
    a: torch.Tensor,  # [slots, R, num_embeddings]
    b: torch.Tensor,  # [slots, dim, R]
    slot_scalings: torch.Tensor,  # float32 [slots, 1]
    rows: torch.Tensor,  # int64 [M], from used_rows
    row_slots: torch.Tensor,  # int64 [M]
    scale: float,
    plan: CpuOpPlan,
) -> None:
    """The delta of checked arguments by a plan made for them: each used row's column of its slot's A,
    scaled by ``scale``, then the planned expand."""
    looked_up = a[row_slots, :, ids.index_select(0, rows)]  # [M, R]
    if scale != 1.0:
        looked_up = looked_up * scale
    v = out.new_zeros(out.shape[0], a.shape[1])
    v.index_copy_(0, rows, looked_up)
    expand_planned(out, v, b, slot_scalings, (0, out.shape[1]), plan)


def embedding_delta_torch(
    out: torch.Tensor,
    ids: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    meta: KernelMeta,
    scale: float = 1.0,
) -> None:
    slot_scalings = meta.expand_layout()[0]
    check_embedding_args(out, ids, a, b, meta)
    check_expand_memory(out, ids=ids, a=a, b=b, slot_scalings=slot_scalings)
    plan = plan_for(meta, out.shape[0], b.shape[2], out.dtype, kernel_ok(out.dtype, out, b, slot_scalings))
    rows, row_slots = used_rows(meta)
    if rows.numel():
        lowest, highest = torch.aminmax(ids.index_select(0, rows))
        if int(lowest) < 0 or int(highest) >= a.shape[2]:
            raise OpArgumentError(
                f"ids holds {int(lowest)}..{int(highest)} outside the embedding's [0, {a.shape[2]})"
            )
    if not plan.empty:
        lookup_expand(out, ids, a, b, slot_scalings, rows, row_slots, scale, plan)


def embedding_delta_fake(
    out: torch.Tensor,
    ids: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    meta: KernelMeta,
    scale: float = 1.0,
) -> None:
    check_embedding_args(out, ids, a, b, meta)


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

    Returns ``out``. One call checks and plans everything; the LoRA layers on the CPU plan once per step
    and group instead.

    Raises:
        OpArgumentError: a shape, dtype or device that does not fit, an id outside the embedding, segment
            contents :func:`lora_pin.ops.expand` refuses, or ``out`` requires grad with grad mode on.
    """
    refuse_grad(out)
    torch.ops.lora_pin.embedding_delta_(out, ids, a, b, *expand_args(meta), scale)
    return out
