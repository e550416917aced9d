"""Plain float64 references for the ``lora_pin`` ops: a loop over tokens, written for clarity, not speed.

Tests and ``benches/gpu_ops.py`` check every implementation against these. They compute in float64 on
the inputs' device and round once to the result dtype, so the only error they carry is that rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_pin.ops.segments import KernelMeta

__all__ = ["expand_reference", "lora_reference", "shrink_reference"]


def _segments(meta: KernelMeta) -> list[tuple[int, int]]:
    """(token, slot) for every row covered by a segment with a slot (slot >= 0)."""
    perm_l, indptr, slots = meta.perm.tolist(), meta.seg_indptr.tolist(), meta.seg_slots.tolist()
    return [
        (perm_l[i], slot)
        for s, slot in enumerate(slots)
        if slot >= 0
        for i in range(indptr[s], indptr[s + 1])
    ]


def shrink_reference(x: torch.Tensor, a: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    """``v[t, s*R : s*R + rank] = x[t] @ a[slot, s*R : s*R + rank]ᵀ``; see :func:`lora_pin.ops.shrink`.

    Returns ``[T, n_slices * R]`` in ``x.dtype`` (``R = a.shape[1] // n_slices``), zero where no segment
    with a slot covers the row and beyond each slice's rank.
    """
    n_slices = meta.n_slices
    max_rank = a.shape[1] // n_slices
    ranks = meta.ranks().tolist()
    v = torch.zeros(x.shape[0], n_slices * max_rank, dtype=torch.float64, device=x.device)
    for token, slot in _segments(meta):
        for s in range(n_slices):
            lo, hi = s * max_rank, s * max_rank + ranks[slot][s]
            v[token, lo:hi] = a[slot, lo:hi].double() @ x[token].double()
    return v.to(x.dtype)


def expand_reference(out: torch.Tensor, v: torch.Tensor, b: torch.Tensor, meta: KernelMeta) -> torch.Tensor:
    """What :func:`lora_pin.ops.expand` leaves in ``out``, as a new tensor (``out`` is not changed).

    For covered rows, slice ``s`` of ``new[t]`` is ``out[t, o_s:o_{s+1}]`` plus
    ``scaling[slot, s] * v[t, s*R : s*R + rank] @ b[slot, o_s:o_{s+1}, :rank]ᵀ``; every other row is a
    bit-exact copy of ``out``.
    """
    slot_scalings, slice_offsets = meta.expand_layout()
    n_slices = len(slice_offsets) - 1
    max_rank = b.shape[2]
    ranks, scalings = meta.ranks().tolist(), slot_scalings.tolist()
    new = out.clone()
    for token, slot in _segments(meta):
        for s in range(n_slices):
            rank = ranks[slot][s]
            if rank == 0:
                continue
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            delta = b[slot, lo:hi, :rank].double() @ v[token, s * max_rank : s * max_rank + rank].double()
            new[token, lo:hi] = (out[token, lo:hi].double() + scalings[slot][s] * delta).to(out.dtype)
    return new


def lora_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: Sequence[int],
) -> torch.Tensor:
    """The whole LoRA delta from a per-token slot map, independent of any segment arrays.

    ``new[t, slice s] = out[t, slice s] + scaling * (x[t] @ A_sᵀ) @ B_sᵀ`` in float64 with no
    intermediate rounding, for every token whose slot is not ``-1``; other rows are copied bit-exactly.

    Args:
        out: ``[T, out_total]``, the base layer's output (not changed).
        x: ``[T, in]``.
        a: ``[slots, n_slices * R, in]``; b: ``[slots, out_total, R]``.
        token_slots: integer ``[T]``, ``-1`` for no adapter.
        slot_ranks: int ``[slots, n_slices]``; slot_scalings: float ``[slots, n_slices]``.
        slice_offsets: ``n_slices + 1`` column offsets into ``out``.
    """
    n_slices = len(slice_offsets) - 1
    max_rank = b.shape[2]
    ranks, scalings = slot_ranks.tolist(), slot_scalings.tolist()
    new = out.clone()
    for token, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s in range(n_slices):
            rank = ranks[slot][s]
            if rank == 0:
                continue
            a_s = a[slot, s * max_rank : s * max_rank + rank].double()
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            delta = b[slot, lo:hi, :rank].double() @ (a_s @ x[token].double())
            new[token, lo:hi] = (out[token, lo:hi].double() + scalings[slot][s] * delta).to(out.dtype)
    return new
