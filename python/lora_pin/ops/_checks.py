"""Shape, dtype and device checks shared by every implementation of the ops and by their fake impls.

They read metadata only (never tensor contents), so they are safe on the CUDA path, inside a CUDA
graph capture and under fake tensors; with symbolic shapes they become guards.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from lora_pin.errors import OpArgumentError

__all__ = ["MAX_SLICES", "OpArgumentError", "check_expand_args", "check_shrink_args"]

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


def _check_segments(
    device: torch.device,
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
    n_tokens: int,
) -> None:
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


def check_shrink_args(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    perm: torch.Tensor,  # int64 [N]
    seg_indptr: torch.Tensor,  # int32 [S + 1]
    seg_slots: torch.Tensor,  # int32 [S]
    slot_ranks: torch.Tensor,  # int32 [slots, n_slices]
    n_slices: int,
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
    _require(1 <= n_slices <= MAX_SLICES, lambda: f"n_slices must be in [1, {MAX_SLICES}], got {n_slices}")
    _require(
        a.shape[1] % n_slices == 0,
        lambda: f"a.shape[1]={a.shape[1]} is not a multiple of n_slices={n_slices}",
    )
    _require(
        slot_ranks.shape[0] == a.shape[0],
        lambda: f"slot_ranks has {slot_ranks.shape[0]} slots, a has {a.shape[0]}",
    )
    _check_segments(x.device, perm, seg_indptr, seg_slots, slot_ranks, n_slices, x.shape[0])
    return a.shape[1] // n_slices


def check_expand_args(
    out: torch.Tensor,  # [T, out_total]
    v: torch.Tensor,  # [T, n_slices * R]
    b: torch.Tensor,  # [slots, out_total, R]
    perm: torch.Tensor,  # int64 [N]
    seg_indptr: torch.Tensor,  # int32 [S + 1]
    seg_slots: torch.Tensor,  # int32 [S]
    slot_ranks: torch.Tensor,  # int32 [slots, n_slices]
    slot_scalings: torch.Tensor,  # float32 [slots, n_slices]
    slice_offsets: Sequence[int],  # n_slices + 1 ints, 0 .. out_total
) -> int:
    """Validates :func:`lora_pin.ops.expand`'s arguments; returns the max rank ``R``.

    Raises:
        OpArgumentError: the first mismatch found, naming the argument and its shape or dtype.
    """
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
    _check_segments(out.device, perm, seg_indptr, seg_slots, slot_ranks, n_slices, out.shape[0])
    return max_rank
