"""The token grouping of the active step, as the LoRA layers read it: :class:`StepSegments`, built from
the core's segment arrays (:func:`arrays_on`).

The core sorts a step's tokens by slot and cuts the segments (``StepPlan.step_arrays``, and
``StepPlan.subset`` for the sub-batch an engine built); this module only puts those arrays on the device
and, for a per-sequence batch, derives the segments of ``L`` rows per sequence from the core's one-token
segments by arithmetic (no sort, so ``torch.compile(fullgraph=True)`` traces it).
"""

from __future__ import annotations

import torch

from lora_pin.errors import UsageError
from lora_pin.ops import KernelMeta, segments_from_slots
from lora_pin.ops.paged import PageTable

__all__ = ["DevicePages", "StepSegments", "arrays_on"]


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
    ``pages``: a paged pool's page tables for the step (:class:`DevicePages`), None with slots.
    What the kernels keep for a step is the backend's (:mod:`lora_pin.ops.backends`), not the step's.

    A plain class with ``__slots__``: every step builds one.
    """

    __slots__ = (
        "_adapter_sequences",
        "_adapter_slots",
        "_by_length",
        "any_adapter",
        "chunk_size",
        "pages",
        "segments",
        "sequence_slots",
    )

    def __init__(
        self,
        segments: KernelMeta | None = None,
        sequence_slots: torch.Tensor | None = None,
        chunk_size: int | None = None,
        any_adapter: bool = True,
        pages: PageTable | None = None,
    ) -> None:
        self.segments = segments
        self.pages = pages
        self.sequence_slots = sequence_slots
        self.chunk_size = chunk_size
        self.any_adapter = any_adapter
        # Per sequence: segments by rows per sequence, the adapter sequences (int64 [N1], grouped by
        # slot) and their slots (int32 [N1]).
        self._by_length: dict[int, KernelMeta] = {}
        self._adapter_sequences: torch.Tensor | None = None
        self._adapter_slots: torch.Tensor | None = None
        if sequence_slots is not None and segments is not None:
            # The planner's one-token segments list the adapter sequences grouped by slot.
            self._adapter_sequences = segments.perm
            self._adapter_slots = sequence_slots.index_select(0, segments.perm).to(torch.int32)
            self._by_length[1] = segments

    def __repr__(self) -> str:
        return (
            f"StepSegments(segments={self.segments}, sequence_slots={self.sequence_slots}, "
            f"chunk_size={self.chunk_size}, any_adapter={self.any_adapter}, pages={self.pages})"
        )

    def for_input(self, x: torch.Tensor) -> KernelMeta:
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

    def _segments_of_length(self, length: int) -> KernelMeta:
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
        return KernelMeta(perm, seg_indptr, seg_slots)


def arrays_on(
    data: bytearray, words: tuple[int, int, int, int], device: torch.device
) -> tuple[torch.Tensor, KernelMeta]:
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
    return request_slots, KernelMeta(perm, seg_indptr, seg_slots)


def _part(data: bytearray, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``data``, sharing its memory."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)


class DevicePages:
    """A paged pool's page tables on the device, step after step (``StepPlan.page_indptr`` and
    ``StepPlan.page_table``): one copy of both when they change, views of it, and the same
    :class:`~lora_pin.ops.paged.PageTable` as the last step's when they have not (they change only when
    adapters enter or leave the device tier), so most steps copy nothing.

    Args:
        page_rank: the pool's ranks per page.
        device: the pool's device.
    """

    def __init__(self, page_rank: int, device: torch.device) -> None:
        self.page_rank = page_rank
        self.device = device
        self._last: tuple[bytes, bytes, PageTable] | None = None

    def of(self, indptr: bytes, table: bytes) -> PageTable:
        """The tables of int32 bytes ``indptr`` (``[slots + 1]``) and ``table`` (``[P]``) on the device."""
        last = self._last
        if last is not None and last[0] == indptr and last[1] == table:
            return last[2]
        both = torch.frombuffer(bytearray(indptr) + bytearray(table), dtype=torch.int32)
        # From pinned memory a CUDA copy is queued and the host goes on (as arrays_on does).
        both = both.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else both
        n_indptr = len(indptr) // 4
        pages = PageTable(both[:n_indptr], both[n_indptr:], self.page_rank)
        self._last = (bytes(indptr), bytes(table), pages)
        return pages
