"""Shape, dtype and device checks shared by every implementation of the ops and by their fake impls.

They read metadata only (never tensor contents), so they are safe on the CUDA path, inside a CUDA
graph capture and under fake tensors; with symbolic shapes they become guards.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops.segments import KernelMeta

__all__ = ["MAX_SLICES", "OpArgumentError", "check_dora_args", "check_expand_args", "check_shrink_args"]

# The fused Triton expand takes slice offsets as scalar kernel arguments (no host-to-device copy, so a
# CUDA graph can capture it); q/k/v and gate/up need 3 and 2.
MAX_SLICES = 8

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _require(ok: bool, message: Callable[[], str]) -> None:
    # The message is built only on failure: the checks run on every op call.
    if not ok:
        raise OpArgumentError(message())


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_segments(device: torch.device, meta: KernelMeta, n_tokens: int) -> None:
    perm, seg_indptr, seg_slots, slot_ranks, n_slices = meta[:5]
    _require(
        perm.dim() == 1 and perm.dtype == torch.int64,
        lambda: f"perm must be int64 [N], got {_shape(perm)} {perm.dtype}",
    )
    _require(
        perm.shape[0] <= n_tokens,
        lambda: f"perm has {perm.shape[0]} rows but the input has only {n_tokens} tokens",
    )
    _require(
        seg_indptr.dim() == 1 and seg_indptr.dtype == torch.int32 and seg_indptr.shape[0] >= 1,
        lambda: f"seg_indptr must be int32 [S + 1], got {_shape(seg_indptr)} {seg_indptr.dtype}",
    )
    _require(
        seg_slots.dim() == 1
        and seg_slots.dtype == torch.int32
        and seg_slots.shape[0] == seg_indptr.shape[0] - 1,
        lambda: (
            f"seg_slots must be int32 [S] with S = len(seg_indptr) - 1 = {seg_indptr.shape[0] - 1}, "
            f"got {_shape(seg_slots)} {seg_slots.dtype}"
        ),
    )
    _require(
        slot_ranks.dim() == 2 and slot_ranks.dtype == torch.int32 and slot_ranks.shape[1] == n_slices,
        lambda: (
            f"slot_ranks must be int32 [slots, n_slices={n_slices}], "
            f"got {_shape(slot_ranks)} {slot_ranks.dtype}"
        ),
    )
    for name, t in (
        ("perm", perm),
        ("seg_indptr", seg_indptr),
        ("seg_slots", seg_slots),
        ("slot_ranks", slot_ranks),
    ):
        if t.device != device:
            raise OpArgumentError(f"{name} is on {t.device} but the activations are on {device}")


def check_segment_contents(
    perm: torch.Tensor,  # int64 [N]
    indptr: list[int],  # seg_indptr's values
    seg_slots: list[int],  # seg_slots' values
    ranks: list[list[int]],  # slot_ranks' values
    n_tokens: int,
    max_rank: int,
) -> None:
    """Validates what the segment arrays hold (their shapes were checked already). Reads their
    contents, so it is for CPU tensors only: the CUDA path never does.

    Raises:
        OpArgumentError: ``seg_indptr`` does not rise from 0 to ``len(perm)``, a rank is outside
            ``[0, max_rank]``, a slot outside ``[-1, slots)``, or ``perm`` holds a token outside
            ``[0, n_tokens)`` or twice.
    """
    n_rows, n_slots = perm.shape[0], len(ranks)
    if indptr[0] != 0 or indptr[-1] != n_rows or any(lo > hi for lo, hi in itertools.pairwise(indptr)):
        raise OpArgumentError(f"seg_indptr must rise from 0 to len(perm)={n_rows}, got {indptr}")
    if any(not 0 <= r <= max_rank for row in ranks for r in row):
        raise OpArgumentError(f"slot_ranks must lie in [0, max_rank={max_rank}], got {ranks}")
    if any(not -1 <= s < n_slots for s in seg_slots):
        raise OpArgumentError(f"seg_slots must lie in [-1, {n_slots}), got {seg_slots}")
    if n_rows:
        lowest, highest = torch.aminmax(perm)
        if int(lowest) < 0 or int(highest) >= n_tokens:
            raise OpArgumentError(f"perm holds tokens outside [0, {n_tokens}): {int(lowest)}..{int(highest)}")
        counts = torch.bincount(perm, minlength=n_tokens)
        if int(counts.max()) > 1:
            raise OpArgumentError(
                f"perm repeats token {int(counts.argmax())}: a token belongs to one segment"
            )


def check_shrink_args(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    meta: KernelMeta,
) -> int:
    """Validates :func:`lora_pin.ops.shrink`'s arguments; returns the max rank ``R``.

    Raises:
        OpArgumentError: the first mismatch found, naming the argument and its shape or dtype.
    """
    _require(
        x.dim() == 2 and x.dtype in _FLOAT_DTYPES,
        lambda: f"x must be fp16/bf16/fp32 [T, in], got {_shape(x)} {x.dtype}",
    )
    _require(
        a.dim() == 3 and a.dtype == x.dtype and a.shape[2] == x.shape[1],
        lambda: f"a must be {x.dtype} [slots, n_slices * R, in={x.shape[1]}], got {_shape(a)} {a.dtype}",
    )
    _require(a.device == x.device, lambda: f"a is on {a.device} but x is on {x.device}")
    n_slices, slot_ranks = meta.n_slices, meta.ranks()
    _require(1 <= n_slices <= MAX_SLICES, lambda: f"n_slices must be in [1, {MAX_SLICES}], got {n_slices}")
    _require(
        a.shape[1] % n_slices == 0,
        lambda: f"a.shape[1]={a.shape[1]} is not a multiple of n_slices={n_slices}",
    )
    _require(
        slot_ranks.shape[0] == a.shape[0],
        lambda: f"slot_ranks has {slot_ranks.shape[0]} slots, a has {a.shape[0]}",
    )
    _check_segments(x.device, meta, x.shape[0])
    return a.shape[1] // n_slices


def check_expand_args(
    out: torch.Tensor,  # [T, out_total]
    v: torch.Tensor,  # [T, n_slices * R]
    b: torch.Tensor,  # [slots, out_total, R]
    meta: KernelMeta,
) -> int:
    """Validates :func:`lora_pin.ops.expand`'s arguments; returns the max rank ``R``.

    Raises:
        OpArgumentError: the first mismatch found, naming the argument and its shape or dtype; or
            ``meta`` lacks the scalings or slice offsets.
    """
    slot_scalings, slice_offsets = meta.expand_layout()
    n_slices = len(slice_offsets) - 1
    _require(
        out.dim() == 2 and out.dtype in _FLOAT_DTYPES,
        lambda: f"out must be fp16/bf16/fp32 [T, out_total], got {_shape(out)} {out.dtype}",
    )
    _require(
        1 <= n_slices <= MAX_SLICES,
        lambda: f"slice_offsets must hold 2..{MAX_SLICES + 1} ints, got {list(slice_offsets)}",
    )
    _require(
        meta.n_slices == n_slices,
        lambda: f"n_slices={meta.n_slices} but slice_offsets {list(slice_offsets)} hold {n_slices} slices",
    )
    _require(
        slice_offsets[0] == 0
        and slice_offsets[-1] == out.shape[1]
        and all(lo <= hi for lo, hi in itertools.pairwise(slice_offsets)),
        lambda: f"slice_offsets must rise from 0 to out_total={out.shape[1]}, got {list(slice_offsets)}",
    )
    _require(
        b.dim() == 3 and b.dtype == out.dtype and b.shape[1] == out.shape[1],
        lambda: f"b must be {out.dtype} [slots, out_total={out.shape[1]}, R], got {_shape(b)} {b.dtype}",
    )
    max_rank = b.shape[2]
    _require(
        v.dim() == 2
        and v.dtype == out.dtype
        and v.shape[0] == out.shape[0]
        and v.shape[1] == n_slices * max_rank,
        lambda: (
            f"v must be {out.dtype} [T={out.shape[0]}, n_slices * R={n_slices * max_rank}], "
            f"got {_shape(v)} {v.dtype}"
        ),
    )
    slot_ranks = meta.ranks()
    _require(
        slot_ranks.shape[0] == b.shape[0],
        lambda: f"slot_ranks has {slot_ranks.shape[0]} slots, b has {b.shape[0]}",
    )
    _require(
        slot_scalings.dtype == torch.float32 and _shape(slot_scalings) == (b.shape[0], n_slices),
        lambda: (
            f"slot_scalings must be float32 [slots={b.shape[0]}, n_slices={n_slices}], "
            f"got {_shape(slot_scalings)} {slot_scalings.dtype}"
        ),
    )
    for name, t in (("v", v), ("b", b), ("slot_scalings", slot_scalings)):
        if t.device != out.device:
            raise OpArgumentError(f"{name} is on {t.device} but out is on {out.device}")
    _check_segments(out.device, meta, out.shape[0])
    return max_rank


def check_dora_args(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices of :func:`dora_scale_`'s arguments (metadata only, never contents).

    Raises:
        OpArgumentError: naming the argument and what it should be.
    """
    problems = []
    if out.dim() != 2 or out.dtype not in _FLOAT_DTYPES:
        problems.append(f"out must be [T, O] fp16/bf16/fp32, got {tuple(out.shape)} {out.dtype}")
    width = out.shape[-1]
    if factors.dim() != 2 or factors.shape[1] != width or factors.dtype != out.dtype:
        problems.append(
            f"factors must be [slots, {width}] {out.dtype}, got {tuple(factors.shape)} {factors.dtype}"
        )
    if dora.dim() != 1 or dora.dtype != torch.int32 or dora.shape[0] != factors.shape[0]:
        problems.append(f"dora must be int32 [{factors.shape[0]}], got {tuple(dora.shape)} {dora.dtype}")
    if rows.dim() != 1 or rows.dtype != torch.int64:
        problems.append(f"rows must be int64 [N], got {tuple(rows.shape)} {rows.dtype}")
    if row_slots.dim() != 1 or row_slots.dtype != torch.int32 or row_slots.shape != rows.shape:
        problems.append(
            f"row_slots must be int32 [{rows.shape[0]}], got {tuple(row_slots.shape)} {row_slots.dtype}"
        )
    if bias is not None and (bias.shape != (width,) or bias.dtype != out.dtype):
        problems.append(f"bias must be [{width}] {out.dtype} or None, got {tuple(bias.shape)} {bias.dtype}")
    tensors = [out, factors, dora, rows, row_slots] + ([] if bias is None else [bias])
    if len({t.device for t in tensors}) != 1:
        problems.append(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if problems:
        raise OpArgumentError("dora_scale_: " + "; ".join(problems))


def check_expand_memory(out: torch.Tensor, **read: torch.Tensor) -> None:
    """Refuses an ``out`` that shares memory with a tensor expand reads (real tensors only: it looks at
    their storage, so the fake impls used in tracing do not call it).

    Raises:
        OpArgumentError: naming the tensor ``out`` overlaps.
    """
    for name, t in read.items():
        if _overlap(out, t):
            raise OpArgumentError(f"out overlaps {name} in memory: expand writes out while it reads {name}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share bytes (by the extents of their strided views; no data is read)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def extent(t: torch.Tensor) -> tuple[int, int]:
        lo = t.storage_offset() * t.element_size()
        span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return lo, lo + (span + 1) * t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = extent(a), extent(b)
    return a_lo < b_hi and b_lo < a_hi


def stand_in(t: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A stand-in of ``[rows, columns]`` of ``t``'s dtype and device for the checks, which read shapes,
    dtypes and devices only: one element stands for the whole tensor (a step's checks made once, before
    its inputs exist)."""
    return t.new_empty_strided((rows, columns), (0, 0))


def refuse_grad(*tensors: torch.Tensor) -> None:
    """Refuses tensors that require grad with grad mode on: the ops have no autograd formula.

    Raises:
        OpArgumentError: one of ``tensors`` requires grad and grad mode is on.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise OpArgumentError(
            "lora_pin ops have no autograd formula; run them under torch.inference_mode() or torch.no_grad()"
        )


def check_prepared_shrink(
    what: str, dtype: torch.dtype, n_tokens: int, in_features: int, x: torch.Tensor
) -> None:
    """Refuses an ``x`` other than the ``[n_tokens, in_features]`` of ``dtype`` a step's shrink
    (``what``, named in the message) was prepared for, or one that requires grad.

    Raises:
        OpArgumentError: naming what was prepared and what came.
    """
    if x.dtype is not dtype or x.shape != (n_tokens, in_features):
        raise OpArgumentError(
            f"{what} was prepared for x {dtype} [{n_tokens}, {in_features}], got x {x.dtype} {tuple(x.shape)}"
        )
    refuse_grad(x)


def check_prepared_expand(
    what: str,
    dtype: torch.dtype,
    n_tokens: int,
    out_total: int,
    width: int,
    out: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Refuses an ``out`` other than ``[n_tokens, out_total]`` or a ``v`` other than ``[n_tokens,
    width]``, of ``dtype``, that a step's expand (``what``) was prepared for, or either requiring grad.

    Raises:
        OpArgumentError: naming what was prepared and what came.
    """
    if (
        out.dtype is not dtype
        or v.dtype is not dtype
        or out.shape != (n_tokens, out_total)
        or v.shape != (n_tokens, width)
    ):
        raise OpArgumentError(
            f"{what} was prepared for out {dtype} [{n_tokens}, {out_total}] and v [{n_tokens}, {width}], "
            f"got out {out.dtype} {tuple(out.shape)} and v {v.dtype} {tuple(v.shape)}"
        )
    refuse_grad(out, v)


def same_tensor_kind(t: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``t`` passes every check ``other`` passed: same shape, dtype, device and contiguity."""
    return (
        t.shape == other.shape
        and t.dtype is other.dtype
        and t.device == other.device
        and t.is_contiguous() == other.is_contiguous()
    )
