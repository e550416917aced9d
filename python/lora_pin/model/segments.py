"""The token grouping of the active step, as the LoRA layers read it: :class:`StepSegments`, built from
the core's segment arrays (:func:`arrays_on`).

The core sorts a step's tokens by slot and cuts the segments (``StepPlan.step_arrays``, and
``StepPlan.subset`` for the sub-batch an engine built); this module only puts those arrays on the device
and, for a per-sequence batch, derives the segments of ``L`` rows per sequence from the core's one-token
segments by arithmetic (no sort, so ``torch.compile(fullgraph=True)`` traces it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lora_pin.errors import UsageError
from lora_pin.ops import (
    KernelMeta,
    PreparedDelta,
    PreparedExpand,
    PreparedShrink,
    SegmentBatch,
    prepare_delta,
    prepare_expand,
    prepare_shrink,
    segments_from_slots,
)
from lora_pin.ops.embedding import PreparedEmbeddingDelta, prepare_embedding_delta
from lora_pin.weights.pool import GroupBuffers

__all__ = ["StepSegments", "arrays_on"]


class StepSegments:
    """The token grouping of the active step, as the LoRA layers need it.

    Two ways to describe a step:

    - *packed* (``segments`` set): the layers see ``[T, in]`` inputs whose rows are the step's tokens, in
      the order the planner's segment arrays index; rows past them (padding to a CUDA-graph size, say)
      get no adapter, so a deferred request's tokens must not be fed;
    - *per sequence* (``sequence_slots`` set, and the planner's one-token ``segments``): the layers see
      ``[B, L, in]`` (or ``[B * L, in]``) inputs with one slot per sequence. One-token inputs use the
      planner's segments; for ``L`` tokens each adapter sequence's ``L`` rows are cut into segments of at
      most ``chunk_size`` rows by arithmetic on the sequences the step built when it began (no sort and
      no data-dependent shape in the forward, so ``torch.compile(fullgraph=True)`` traces it).

    ``any_adapter`` is False when every row is base-model only: the layers then skip the ops entirely.
    On CPU each layer group's delta is checked and planned once per step and input shape
    (:meth:`delta_for`), and a group that no row of the step uses is skipped without an op call.

    A plain class with ``__slots__``: every step builds one.
    """

    __slots__ = (
        "_adapter_sequences",
        "_adapter_slots",
        "_by_length",
        "_deltas",
        "_dora_rows",
        "_embedding_deltas",
        "_shared",
        "_split_deltas",
        "_split_shared",
        "any_adapter",
        "chunk_size",
        "segments",
        "sequence_slots",
    )

    def __init__(
        self,
        segments: SegmentBatch | None = None,
        sequence_slots: torch.Tensor | None = None,
        chunk_size: int | None = None,
        any_adapter: bool = True,
    ) -> None:
        self.segments = segments
        self.sequence_slots = sequence_slots
        self.chunk_size = chunk_size
        self.any_adapter = any_adapter
        # Per sequence: segments by rows per sequence, the adapter sequences (int64 [N1], grouped by
        # slot) and their slots (int32 [N1]).
        self._by_length: dict[int, SegmentBatch] = {}
        self._adapter_sequences: torch.Tensor | None = None
        self._adapter_slots: torch.Tensor | None = None
        # (group's A buffer, input shape less features) -> the group's prepared delta in this step (CPU).
        self._deltas: dict[tuple[int, torch.Size], PreparedDelta] = {}
        # (input shape less features, A's shape, B's shape) -> the last group prepared in full with them.
        self._shared: dict[tuple[torch.Size, ...], PreparedDelta] = {}
        # (DoRA slots of a group, input shape less features) -> the step's rows in them and their slots.
        self._dora_rows: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor] | None] = {}
        # (group's A buffer, input shape less features) -> its prepared shrink and expand, run apart (CPU).
        self._split_deltas: dict[tuple[int, torch.Size], tuple[PreparedShrink, PreparedExpand]] = {}
        # As _shared, for the shrinks and expands run apart.
        self._split_shared: dict[tuple[torch.Size, ...], tuple[PreparedShrink, PreparedExpand]] = {}
        # (embedding group's A buffer, output shape less features) -> its prepared delta (CPU).
        self._embedding_deltas: dict[tuple[int, torch.Size], PreparedEmbeddingDelta] = {}
        if sequence_slots is not None and segments is not None:
            # The planner's one-token segments list the adapter sequences grouped by slot.
            self._adapter_sequences = segments.perm
            self._adapter_slots = sequence_slots.index_select(0, segments.perm).to(torch.int32)
            self._by_length[1] = segments

    def __repr__(self) -> str:
        return (
            f"StepSegments(segments={self.segments}, sequence_slots={self.sequence_slots}, "
            f"chunk_size={self.chunk_size}, any_adapter={self.any_adapter})"
        )

    def for_input(self, x: torch.Tensor) -> SegmentBatch:
        """The segments for layer input ``x`` (``[T, in]`` packed, ``[B, L, in]`` per sequence).

        Raises:
            UsageError: ``x`` does not have the step's shape: its rows (or, for ``[B, L, in]``, its batch
                ``B``) are not a multiple of the step's sequences. A multiple is taken for that many
                contiguous copies of each sequence, as beam search makes.
        """
        if self.sequence_slots is None:
            assert self.segments is not None
            return self.segments
        batch = self.sequence_slots.shape[0]
        rows = x.numel() // x.shape[-1]
        if rows % batch or (x.dim() == 3 and x.shape[0] % batch):
            raise UsageError(
                f"LoRA step: the layer input {tuple(x.shape)} does not split into the step's {batch} "
                "sequences (batch() was given one name per sequence of the batch)"
            )
        length = rows // batch
        cached = self._by_length.get(length)
        if cached is None:
            cached = self._segments_of_length(length)
            self._by_length[length] = cached
        return cached

    def delta_for(self, buffers: GroupBuffers, x: torch.Tensor) -> PreparedDelta:
        """The step's LoRA delta in the layer group of ``buffers`` for CPU input ``x`` (``[..., in]``),
        checked and planned on the first call of the step for that group and shape.

        Raises:
            UsageError: as :meth:`for_input`.
            OpArgumentError: as :func:`lora_pin.ops.prepare_delta`.
        """
        # By the identity of the group's A buffer, which the entry holds, so the id stays its own.
        key = (id(buffers.a), x.shape[:-1])
        delta = self._deltas.get(key)
        if delta is None:
            seg = self.for_input(x)
            meta = KernelMeta.for_layer(seg, buffers.ranks, buffers.scalings, buffers.slice_offsets)
            # Each layer runs once a step: groups of one shape share the checks and plan of the first.
            shape_key = (x.shape[:-1], buffers.a.shape, buffers.b.shape)
            like = self._shared.get(shape_key)
            delta = prepare_delta(meta, buffers.a, buffers.b, x.numel() // x.shape[-1], like=like)
            if like is None or delta.plan is not like.plan:
                self._shared[shape_key] = delta
            self._deltas[key] = delta
        return delta

    def split_delta_for(
        self,
        buffers: GroupBuffers,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        shrink_ranks: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[PreparedShrink, PreparedExpand]:
        """The step's LoRA shrink and expand in the layer group of ``buffers`` for CPU input ``x``
        (``[..., in]``), for a layer that runs them apart (a fully sharded tensor-parallel layer, with a
        collective between them); checked and planned on the first call of the step for that group and
        shape, and shared with groups of the same shapes and ranks as :meth:`delta_for` shares.

        Args:
            buffers: the group's buffers; the expand runs over ``buffers.b`` with the group's ranks,
                which decide its ``empty`` (the same on every process of a tensor-parallel group).
            x: the layer input.
            slice_offsets: the slices' columns in the expand's output (a fully sharded row layer's
                own columns: ``(0, out_total / tp)``).
            shrink_ranks: returns the int32 ``[slots, n_slices]`` ranks of ``buffers.a``'s rows when they
                are not the group's (a column layer's chunk of each slot's rank); called on the first
                call of the step only.

        Raises:
            UsageError: as :meth:`for_input`.
            OpArgumentError: as :func:`lora_pin.ops.prepare_shrink` and :func:`~lora_pin.ops.prepare_expand`.
        """
        key = (id(buffers.a), x.shape[:-1])
        found = self._split_deltas.get(key)
        if found is None:
            seg = self.for_input(x)
            meta = KernelMeta.for_layer(seg, buffers.ranks, buffers.scalings, slice_offsets)
            local = meta if shrink_ranks is None else meta._replace(slot_ranks=shrink_ranks())
            n_tokens = x.numel() // x.shape[-1]
            shape_key = (x.shape[:-1], buffers.a.shape, buffers.b.shape)
            like = self._split_shared.get(shape_key)
            found = (
                prepare_shrink(local, buffers.a, n_tokens, like=None if like is None else like[0]),
                prepare_expand(meta, buffers.b, n_tokens, like=None if like is None else like[1]),
            )
            if like is None or found[0].plan is not like[0].plan or found[1].plan is not like[1].plan:
                self._split_shared[shape_key] = found
            self._split_deltas[key] = found
        return found

    def embedding_delta_for(
        self, buffers: GroupBuffers, out: torch.Tensor, scale: Callable[[], float]
    ) -> PreparedEmbeddingDelta:
        """The step's LoRA delta in the embedding group of ``buffers`` for its CPU output ``out``
        (``[..., dim]``), checked and planned on the first call of the step for that group and shape;
        ``scale`` gives the factor of the looked-up columns then (:func:`prepare_embedding_delta`).

        Raises:
            UsageError: as :meth:`for_input`.
            OpArgumentError: as :func:`lora_pin.ops.embedding.prepare_embedding_delta`.
        """
        key = (id(buffers.a), out.shape[:-1])
        delta = self._embedding_deltas.get(key)
        if delta is None:
            seg = self.for_input(out)
            meta = KernelMeta.for_layer(seg, buffers.ranks, buffers.scalings, buffers.slice_offsets)
            n_tokens = out.numel() // out.shape[-1]
            delta = prepare_embedding_delta(meta, buffers.a, buffers.b, n_tokens, scale())
            self._embedding_deltas[key] = delta
        return delta

    def dora_rows_for(
        self, buffers: GroupBuffers, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of layer input ``x`` to rescale as DoRA rows in the group of ``buffers`` and their
        slots (int64 ``[N]`` and ``[N]``: int64 for :func:`lora_pin.ops.dora.scale_rows_` on the CPU,
        int32 for :func:`lora_pin.ops.dora_scale_` otherwise), or None when there are none; made once
        per step, group DoRA slots and input shape.

        On the CPU they are exactly the rows of the group's DoRA slots (read from the host arrays); on a
        device, or traced by ``torch.compile``, they are every adapter row, and the op skips the others
        by the slots' flags (no read of the arrays from the host), whether or not a DoRA adapter is in
        the pool now: a captured graph or a compiled step must not depend on ``dora_slots``, which a
        later load changes while the flags change in place. None for buffers with no DoRA factors.

        Raises:
            UsageError: as :meth:`for_input`.
        """
        dora_slots = buffers.dora_slots
        # Traced by torch.compile, as on a device: no read of the arrays from the host.
        on_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
        if dora_slots is None or (on_cpu and not dora_slots):
            return None
        key = (frozenset(dora_slots) if on_cpu else None, x.shape[:-1])
        if key in self._dora_rows:
            return self._dora_rows[key]
        seg = self.for_input(x)
        counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
        row_slots = torch.repeat_interleave(seg.seg_slots, counts, output_size=seg.perm.shape[0])
        picked: tuple[torch.Tensor, torch.Tensor] | None = (seg.perm, row_slots)
        if on_cpu:
            chosen = torch.isin(row_slots, torch.tensor(sorted(dora_slots), dtype=row_slots.dtype))
            # int64 slots: what the prepared rescale indexes with (scale_rows_), converted once a step.
            picked = (seg.perm[chosen], row_slots[chosen].long()) if bool(chosen.any()) else None
        self._dora_rows[key] = picked
        return picked

    def _segments_of_length(self, length: int) -> SegmentBatch:
        """Segments for ``length`` rows per sequence: each adapter sequence's rows, cut into chunks."""
        if self._adapter_sequences is None or self._adapter_slots is None:
            assert self.sequence_slots is not None
            token_slots = torch.repeat_interleave(self.sequence_slots, length)
            return segments_from_slots(token_slots, self.chunk_size)
        sequences, slots = self._adapter_sequences, self._adapter_slots
        device = sequences.device
        chunk = length if self.chunk_size is None else min(self.chunk_size, length)
        per_sequence = -(-length // chunk)
        rows = torch.arange(length, device=device)
        perm = (sequences.unsqueeze(1) * length + rows).reshape(-1)
        starts = torch.arange(per_sequence, device=device, dtype=torch.int32) * chunk
        firsts = torch.arange(sequences.shape[0], device=device, dtype=torch.int32).unsqueeze(1) * length
        body = (firsts + starts).reshape(-1)
        total = torch.full((1,), sequences.shape[0] * length, device=device, dtype=torch.int32)
        seg_indptr = torch.cat([body, total])
        seg_slots = slots.repeat_interleave(per_sequence)
        return SegmentBatch(perm, seg_indptr, seg_slots)


def arrays_on(
    data: bytearray, words: tuple[int, int, int, int], device: torch.device
) -> tuple[torch.Tensor, SegmentBatch]:
    """``(request_slots, segments)`` from the core's one buffer (``StepPlan.step_arrays`` or
    ``StepPlan.subset``; ``words``: its parts' lengths in int32 words): one tensor, one copy to the device,
    and views of it. On CPU the tensors share the buffer's memory (never write into them)."""
    if device.type == "cpu":
        # Views of the buffer, each by its own dtype: no copy (the tensors share the fresh bytearray).
        n_perm, n_requests, n_indptr, n_segments = words
        perm = _part(data, torch.int64, n_perm // 2, 0)
        at = 4 * n_perm
        request_slots = _part(data, torch.int32, n_requests, at)
        at += 4 * n_requests
        seg_indptr = _part(data, torch.int32, n_indptr, at)
        seg_slots = _part(data, torch.int32, n_segments, at + 4 * n_indptr)
    else:
        # One copy to the device, then views of it. Never empty: seg_indptr has its leading 0.
        flat = torch.frombuffer(data, dtype=torch.int32)
        # From pinned memory a CUDA copy is queued on the stream and the host goes on: a copy from
        # pageable memory would wait for every kernel already queued. (The caching host allocator keeps
        # the pinned block until the copy has run.)
        flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
        perm32, request_slots, seg_indptr, seg_slots = flat.split_with_sizes(words)
        perm = perm32.view(torch.int64)
    return request_slots, SegmentBatch(perm, seg_indptr, seg_slots)


def _part(data: bytearray, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``data``, sharing its memory."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
