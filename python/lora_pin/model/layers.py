"""LoRA layers: wrappers around a model's target linears that add every row's adapter delta.

A :class:`LoRALinear` keeps the base layer untouched and, while a step is active, adds
``scaling * B[slot] (A[slot] x)`` to each row whose request uses an adapter, through the ``lora_pin``
shrink/expand ops over the device pool's buffers; a row of a DoRA adapter is then rescaled by its
factor around the bias (:mod:`lora_pin.weights.dora`). Rows with no adapter are never touched, so they
equal the base model's output bit for bit. With no active step the wrapper is the base layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lora_pin.errors import SpecError, UsageError
from lora_pin.ops import (
    KernelMeta,
    OpArgumentError,
    PreparedDelta,
    PreparedExpand,
    PreparedShrink,
    SegmentBatch,
    dora_scale_,
    expand,
    prepare_delta,
    prepare_expand,
    prepare_shrink,
    segments_from_slots,
    shrink,
)
from lora_pin.ops.dora import scale_rows_
from lora_pin.ops.embedding import PreparedEmbeddingDelta, prepare_embedding_delta
from lora_pin.weights.pool import GroupBuffers

__all__ = ["BaseLayerWrapper", "LoRAEmbedding", "LoRALinear", "StepSegments"]


def rescales_dora(buffers: GroupBuffers, x: torch.Tensor) -> bool:
    """Whether a layer's forward over ``x`` off the CPU eager path rescales the DoRA rows of ``buffers``'
    group: while a DoRA adapter sits in its slots, and, for a pool that can hold DoRA, always when traced by
    ``torch.compile`` or captured into a CUDA graph, which a DoRA load after the capture must not find
    without the rescale (see :meth:`StepSegments.dora_rows_for`). Eager device steps with no DoRA slot
    skip it: one kernel launch per layer and step."""
    if buffers.dora_slots is None:
        return False
    if buffers.dora_slots or torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


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


class BaseLayerWrapper(torch.nn.Module):
    """A module that wraps ``base_layer`` in a model: attributes it does not have itself (``weight``,
    ``bias``, ``in_features``, a framework's own fields) are the base layer's, so code that reads them
    through the wrapper (Mamba's mixer reads ``dt_proj.weight``) sees the model it was written for."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__["_modules"].get("base_layer")
            if base is None:
                raise
            return getattr(base, name)


class LoRALinear(BaseLayerWrapper):
    """``base_layer(x)`` plus each row's adapter delta from one device-pool group.

    The wrapped layer's output is the whole group: one slice for an ordinary linear (``q_proj``), several
    for a fused one (a ``qkv_proj`` whose output is ``[q | k | v]``, serving adapters trained on separate
    ``q_proj``/``k_proj``/``v_proj``): one shrink serves every slice and expand writes each slice's columns.

    Args:
        base_layer: the wrapped linear (kept as is; its weights are never modified); output width
            ``buffers.group.out_total``.
        buffers: the device pool's buffers of this layer's group.
        active_step: returns the active :class:`StepSegments`, or None outside a step.
        returns_bias: ``base_layer`` returns ``(out, bias)`` (see :func:`lora_pin.register_linear`); the
            wrapper then returns the same pair, the delta added to ``out``.
        key: the module's key in the model, for errors.

    Attributes the wrapper does not have itself (``weight``, ``bias``, ``in_features`` ...) are the base
    layer's, so model code that reads them directly (Mamba reads ``dt_proj.weight``) keeps working.
    """

    def __init__(
        self,
        base_layer: torch.nn.Module,
        buffers: GroupBuffers,
        active_step: Callable[[], StepSegments | None],
        *,
        returns_bias: bool = False,
        key: str = "",
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self._returns_bias = returns_bias
        self._key = key
        self._pool_buffers = buffers
        self._active_step = active_step
        self._n_slices = buffers.group.n_slices
        # Where each slice's columns start and end in the output: a tensor-parallel shard has its own.
        self._offsets: Sequence[int] = buffers.slice_offsets
        # The kernel metadata of the last segments seen: every forward of one step reuses it. Keyed by
        # identity, which is safe because the entry holds the segments it was made from.
        self._meta: tuple[SegmentBatch, KernelMeta] | None = None

    def forward(self, x: torch.Tensor) -> Any:
        """``[..., in] -> [..., out_total]``: the base output plus the step's adapter deltas, in place (for a
        layer returning ``(out, bias)``, the same pair with the deltas in ``out``)."""
        result = self.base_layer(x)
        out = result[0] if self._returns_bias else result
        step = self._active_step()
        if step is None or not step.any_adapter:
            return result
        if not isinstance(out, torch.Tensor):
            return self._untouched(result, step.for_input(x))
        buf = self._pool_buffers
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            self._add_prepared_delta(step, out, x)
            return result
        seg = step.for_input(x)
        self._check_dtype("the input", x.dtype, ", or is autocast on (not supported)")
        meta = self._kernel_meta(seg)
        flat_out = out.view(-1, out.shape[-1])
        expand(flat_out, shrink(x.reshape(-1, x.shape[-1]), buf.a, meta), buf.b, meta)
        if rescales_dora(buf, x):
            self._rescale_dora(step, out, x)
        return result

    def _add_prepared_delta(self, step: StepSegments, out: torch.Tensor, x: torch.Tensor) -> None:
        """The delta on the CPU: the group's delta checked and planned once per step, then one op call,
        or none for a group no row uses; then the DoRA rescale of the step's DoRA rows, if any."""
        buf = self._pool_buffers
        delta = step.delta_for(buf, x)
        if not delta.empty:
            if x.dtype is not delta.dtype:
                self._check_dtype("the input", x.dtype, ", or is autocast on (not supported)")
            delta.apply(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]))
        if buf.dora_slots:
            self._rescale_dora(step, out, x)

    def _rescale_dora(self, step: StepSegments, out: torch.Tensor, x: torch.Tensor) -> None:
        """Rescale the step's DoRA rows of ``out`` (base plus LoRA delta) around the base layer's bias:
        ``f * (out - bias) + bias``. A layer returning ``(out, bias)`` left its bias out of ``out``."""
        buf = self._pool_buffers
        picked = step.dora_rows_for(buf, x)
        if picked is None:
            return
        assert buf.factors is not None and buf.dora is not None
        bias = self._dora_bias()
        flat = out.view(-1, out.shape[-1])
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            # Exactly the step's DoRA rows, from its own arrays: no checks or filter left to do.
            if out.dtype is not buf.factors.dtype:
                self._check_dtype("the layer output", out.dtype)
            scale_rows_(flat, bias, buf.factors, *picked)
        else:
            # Every adapter row: the op keeps the DoRA slots' rows by their flags.
            dora_scale_(flat, bias, buf.factors, buf.dora, *picked)

    def _dora_bias(self) -> torch.Tensor | None:
        """The bias in ``out`` that a DoRA row is rescaled around (``[out]``), or None."""
        bias = None if self._returns_bias else getattr(self.base_layer, "bias", None)
        return None if bias is None else bias.detach()

    def _untouched(self, result: Any, seg: SegmentBatch) -> Any:
        """The output of a base layer that returns no tensor (a linear subclass computing its own forward:
        a router's tuple), returned as is when no adapter of the step has weights on this layer (their
        deltas are zero, so that is their exact output).

        Raises:
            SpecError: an adapter of the step has weights here, which cannot be added to such an output.
        """
        slots = seg.seg_slots[seg.seg_slots >= 0].long()
        if not bool((self._pool_buffers.ranks[slots] > 0).any()):
            return result
        kind = type(self.base_layer).__name__
        raise SpecError(
            f"{self._key!r} ({kind}) returned {type(result).__name__}, not the tensor a linear layer "
            "returns, so an adapter's weights on it cannot be added to its output; serve adapters without "
            "weights on it (leave it out of their target_modules)"
        )

    def _check_dtype(self, what: str, dtype: torch.dtype, more: str = "") -> None:
        """Refuse a tensor of another dtype than the pool's (the model's when the manager was built).

        Raises:
            OpArgumentError: naming the layer, ``what`` and both dtypes.
        """
        pool = self._pool_buffers.a.dtype
        if dtype != pool:
            raise OpArgumentError(
                f"{self.extra_repr()}: {what} is {dtype} but the adapter pool is {pool}, the model's dtype "
                "when the LoRAManager was built: was the model moved with .to(dtype) since (build the "
                f"manager after it){more}?"
            )

    def _kernel_meta(self, seg: SegmentBatch) -> KernelMeta:
        cached = self._meta
        if cached is not None and cached[0] is seg:
            return cached[1]
        buf = self._pool_buffers
        meta = KernelMeta.for_layer(seg, buf.ranks, buf.scalings, self._offsets)
        self._meta = (seg, meta)
        return meta

    def extra_repr(self) -> str:
        group = self._pool_buffers.group
        return f"group={group.key!r}, slices={self._n_slices}"


class LoRAEmbedding(LoRALinear):
    """``base_layer(ids)`` plus each adapter token's delta ``scaling * B[slot] A[slot][:, id]``, PEFT's
    embedding LoRA (``lora_embedding_A`` ``[r, num_embeddings]``, ``lora_embedding_B`` ``[dim, r]``).

    The pool holds an embedding's A and B like a linear's (A ``[slots, R, num_embeddings]``, B
    ``[slots, dim, R]``). The shrink of a linear becomes a lookup: each adapter token's column of its
    slot's A is gathered, then the expand adds the B product, scaled, to the base output, so rows
    with no adapter are never touched. The rows are the step's tokens, as for every linear of the step.
    On the CPU the step's delta is checked and planned once per step (one ``lora_pin::embedding_delta_``
    call a forward, none when no row of the step uses the group); elsewhere the columns are gathered
    here and ``lora_pin::expand`` adds them.

    Args:
        base_layer: the wrapped ``nn.Embedding`` (or subclass); kept as is. A one-element ``embed_scale``
            attribute (Gemma's scaled embedding) scales the delta too, as PEFT does.
        buffers: the device pool's buffers of this embedding's group (one slice).
        active_step: returns the active :class:`StepSegments`, or None outside a step.
    """

    def forward(self, x: torch.Tensor) -> Any:
        """Token ids ``[...]`` -> ``[..., dim]``: the base embeddings plus the step's adapter deltas."""
        out = self.base_layer(x)
        step = self._active_step()
        if step is None or not step.any_adapter:
            return out
        buf = self._pool_buffers
        if out.dtype != buf.a.dtype:
            self._check_dtype("the embedding output", out.dtype)
        if out.device.type == "cpu" and not torch.compiler.is_compiling():
            # Checked and planned once per step; a group no row of the step uses makes no op call.
            delta = step.embedding_delta_for(buf, out, lambda: self._embed_scale(out.dtype))
            if not delta.empty:
                delta.apply(out.view(-1, out.shape[-1]), x.reshape(-1).long())
            return out
        # The step's rows are the tokens; the output ([..., dim]) has the shape a linear's input would.
        seg = step.for_input(out)
        meta = self._kernel_meta(seg)
        ids = x.reshape(-1)
        perm = seg.perm
        # Each adapter row's slot, from its segment's (a skipped segment's -1 reads slot 0: expand skips
        # that segment). output_size keeps the shape known without a device-to-host read.
        counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
        row_slots = torch.repeat_interleave(
            seg.seg_slots.long().clamp_min(0), counts, output_size=perm.shape[0]
        )
        looked_up = buf.a[row_slots, :, ids.index_select(0, perm)]
        scale = self._embed_scale_tensor(out)
        if scale is not None:
            # A scaled embedding (Gemma's) scales its output in its forward; PEFT scales the delta alike.
            looked_up = looked_up * scale
        v = out.new_zeros((ids.shape[0], buf.a.shape[1]))
        v.index_copy_(0, perm, looked_up)
        expand(out.view(-1, out.shape[-1]), v, buf.b, meta)
        return out

    def _embed_scale_tensor(self, out: torch.Tensor) -> torch.Tensor | None:
        """A scaled embedding's one-element ``embed_scale`` (Gemma's) in ``out``'s dtype and device, or
        None for a plain embedding."""
        scale = getattr(self.base_layer, "embed_scale", None)
        if isinstance(scale, (int, float)) or (isinstance(scale, torch.Tensor) and scale.numel() == 1):
            return torch.as_tensor(scale, dtype=out.dtype, device=out.device)
        return None

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """The factor of the looked-up columns as the prepared CPU path takes it: ``embed_scale`` rounded
        to ``dtype`` as the device path rounds it (1.0 for a plain embedding)."""
        scale = self._embed_scale_tensor(torch.empty(0, dtype=dtype))
        return 1.0 if scale is None else float(scale)
