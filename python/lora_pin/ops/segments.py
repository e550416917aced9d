"""The kernels' one state object: :class:`KernelMeta`, a step's segment arrays (which tokens use which
device slot, grouped so each group is one small GEMM) and, for one layer group, that group's ranks,
scalings and slice layout.

The Rust planner produces the arrays for every scheduler step; :func:`segments_from_slots` builds the
same arrays in pure torch for tests, benchmarks and callers that run without the planner. As vLLM keeps
one ``LoRAKernelMeta`` per step, a step's segments are one :class:`KernelMeta` (the layer fields unset);
:meth:`KernelMeta.for_layer` adds a layer group's fields to it without a copy, and the ops take it whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from lora_pin.errors import OpArgumentError

__all__ = ["CUDA_CHUNK_SIZE", "KernelMeta", "segments_from_slots"]

# Segment length for the CUDA kernels: their largest row tile, so a long segment (a prefill) is spread
# over many programs, one chunk each, instead of being looped over by one.
CUDA_CHUNK_SIZE = 64


class KernelMeta(NamedTuple):
    """Everything the shrink and expand kernels read about one step: its token grouping and, for one
    layer group, each slot's rank and scaling per slice and the slices' layout.

    - ``perm``: int64 ``[N]``, token indices (into the ``T`` rows of the layer input) of the rows that
      use an adapter, grouped by segment; within a segment in ascending token order.
    - ``seg_indptr``: int32 ``[S + 1]``; segment ``s`` is ``perm[seg_indptr[s]:seg_indptr[s + 1]]``.
    - ``seg_slots``: int32 ``[S]``, the device slot of each segment (``-1``: no adapter, skipped).
    - ``slot_ranks``: int32 ``[slots, n_slices]``, each slot's real rank per slice (0: no work); None for
      a step's segments alone (:meth:`segments`), which no op takes.
    - ``n_slices``: 1 for a plain layer, 3 for fused q/k/v, 2 for gate/up.
    - ``slot_scalings``: float32 ``[slots, n_slices]``, read by expand only.
    - ``slice_offsets``: ``n_slices + 1`` column offsets into expand's ``out``, from 0 to its width,
      read by expand only.

    A step's segments (the planner's arrays, :func:`segments_from_slots`) leave the last four unset;
    :meth:`for_layer` gives a layer group's meta from them, and the ``lora_pin`` ops and everything behind
    them take that whole. A meta made for shrink alone (the registered shrink op's, which is given
    neither) leaves the last two ``None``. The fields are spelled out one by one only at the
    ``torch.library`` boundary (the registered ops' schemas).
    """

    perm: torch.Tensor  # int64 [N]
    seg_indptr: torch.Tensor  # int32 [S + 1]
    seg_slots: torch.Tensor  # int32 [S]
    slot_ranks: torch.Tensor | None = None  # int32 [slots, n_slices]
    n_slices: int = 1
    slot_scalings: torch.Tensor | None = None  # float32 [slots, n_slices]
    slice_offsets: tuple[int, ...] | None = None  # n_slices + 1 ints

    def for_layer(
        self,
        slot_ranks: torch.Tensor,
        slot_scalings: torch.Tensor,
        slice_offsets: Sequence[int],
    ) -> KernelMeta:
        """These segments in a layer group whose pool holds ``slot_ranks`` (int32 ``[slots, n_slices]``)
        and ``slot_scalings`` (float32 ``[slots, n_slices]``) and whose output is cut at
        ``slice_offsets`` (``n_slices + 1`` ints). Nothing is copied or checked here: the ops check it."""
        offsets = tuple(slice_offsets)
        return KernelMeta(
            self.perm, self.seg_indptr, self.seg_slots, slot_ranks, len(offsets) - 1, slot_scalings, offsets
        )

    def segments(self) -> KernelMeta:
        """The step's segments alone (the layer fields dropped)."""
        return KernelMeta(self.perm, self.seg_indptr, self.seg_slots)

    def ranks(self) -> torch.Tensor:
        """``slot_ranks``, for an op.

        Raises:
            OpArgumentError: this meta holds a step's segments alone (:meth:`for_layer` gives a layer's).
        """
        if self.slot_ranks is None:
            raise OpArgumentError(
                "this KernelMeta holds a step's segments alone: the ops take a layer group's "
                "(KernelMeta.for_layer)"
            )
        return self.slot_ranks

    def expand_layout(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``(slot_scalings, slice_offsets)``, the part only expand reads.

        Raises:
            OpArgumentError: this meta was made for shrink alone, or holds segments alone (either is
                ``None``).
        """
        if self.slot_scalings is None or self.slice_offsets is None:
            raise OpArgumentError(
                "expand needs slot_scalings and slice_offsets in its KernelMeta (KernelMeta.for_layer)"
            )
        return self.slot_scalings, self.slice_offsets


def segments_from_slots(
    token_slots: torch.Tensor,
    chunk_size: int | None = None,
    device: torch.device | str | None = None,
) -> KernelMeta:
    """Groups tokens by slot: a stable sort by slot, rows of slot ``-1`` dropped, runs cut into chunks.

    Args:
        token_slots: integer ``[T]``, the device slot of each token, ``-1`` for a token without adapter.
        chunk_size: if given, no segment holds more than this many tokens (a slot's run is cut into
            consecutive chunks; SGLang's Triton backend uses 16). ``None`` keeps one segment per slot.
        device: where the arrays are put; defaults to ``token_slots.device``.

    Returns:
        A :class:`KernelMeta` of the segments alone; segments appear in ascending slot order. Its
        shapes depend on the data, so this is not for use inside a CUDA graph (the planner's arrays are).

    Raises:
        ValueError: ``token_slots`` is not a 1-D integer tensor, holds a value below ``-1``, or
            ``chunk_size`` is not positive.
    """
    if token_slots.dim() != 1 or token_slots.dtype.is_floating_point or token_slots.dtype == torch.bool:
        raise ValueError(
            f"token_slots must be a 1-D integer tensor, got {tuple(token_slots.shape)} {token_slots.dtype}"
        )
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive or None, got {chunk_size}")
    device = token_slots.device if device is None else torch.device(device)
    slots = token_slots.to(torch.int64)
    if slots.numel() and int(slots.min()) < -1:
        raise ValueError(f"token_slots holds {int(slots.min())}; slots are >= 0, or -1 for no adapter")

    sorted_slots, order = torch.sort(slots, stable=True)
    keep = sorted_slots >= 0
    perm = order[keep]
    run_slots, run_counts = torch.unique_consecutive(sorted_slots[keep], return_counts=True)

    if chunk_size is None:
        seg_slots = run_slots
        seg_sizes = run_counts
    else:
        # Run i becomes ceil(count_i / chunk) chunks: all full but the last.
        n_chunks = (run_counts + chunk_size - 1) // chunk_size
        seg_slots = torch.repeat_interleave(run_slots, n_chunks)
        first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
        chunk_index = torch.arange(int(n_chunks.sum()), device=slots.device) - torch.repeat_interleave(
            first_chunk, n_chunks
        )
        remaining = torch.repeat_interleave(run_counts, n_chunks) - chunk_index * chunk_size
        seg_sizes = torch.clamp(remaining, max=chunk_size)

    seg_indptr = torch.zeros(seg_sizes.numel() + 1, dtype=torch.int64, device=slots.device)
    torch.cumsum(seg_sizes, 0, out=seg_indptr[1:])
    return KernelMeta(
        perm=perm.to(device=device, dtype=torch.int64),
        seg_indptr=seg_indptr.to(device=device, dtype=torch.int32),
        seg_slots=seg_slots.to(device=device, dtype=torch.int32),
    )


def same_segments(meta: KernelMeta, other: KernelMeta) -> bool:
    """Whether two metas share the step's segment arrays (by identity) and hold equal ranks: the checks
    and plan made for one then hold for the other."""
    return (
        meta.perm is other.perm
        and meta.seg_indptr is other.seg_indptr
        and meta.seg_slots is other.seg_slots
        and meta.n_slices == other.n_slices
        and _same_ranks(meta.slot_ranks, other.slot_ranks)
    )


def _same_ranks(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype is b.dtype and a.device == b.device and torch.equal(a, b)
