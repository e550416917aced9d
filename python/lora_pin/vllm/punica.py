"""vLLM's LoRA math done by lora_pin's ops: :class:`LoraPinPunicaWrapper`.

vLLM runs every LoRA layer's math through one "punica wrapper" object per model, the class its platform
names in ``get_punica_wrapper()``. This one reads vLLM's own stacked buffers (``lora_a_stacked[i]``
``[slots, 1, R, in]``, ``lora_b_stacked[i]`` ``[slots, 1, out_i, R]``, scaling already folded into B
by vLLM) and runs lora_pin's CPU backend (:class:`~lora_pin.ops.backends.cpu.CpuDelta`: the native
kernels or grouped GEMMs) over segments built from vLLM's per-token slot indices:

- rows without an adapter (slot ``-1``) are never touched, so base rows are bit-identical to a base-only
  run of the same batch (vLLM's CPU ops gather ``lora_b_weights[-1]``, the last slot, for them);
- each slot multiplies only its adapter's rank, not ``--max-lora-rank`` (the rank is recorded when vLLM
  activates the adapter into the slot: :meth:`LoraPinPunicaWrapper.set_slot`);
- a slot multiplies nothing in a layer its adapter has no weights for (vLLM zeroes the slot there), and a
  layer none of the step's adapters has weights for is skipped whole: vLLM gives every linear layer of
  the model LoRA buffers (the MLP's too, for adapters on q/k/v/o only; the token embedding's too) and its
  CPU path multiplies them all, zeros included.

The segments are built once per step (:meth:`update_metadata`) and each layer group's checks and plan
once per step too (``CpuDelta.prepare``). Fused layers (q/k/v, gate/up) keep one slice per projection in
vLLM; the op takes them side by side, so a concatenated copy of each fused layer's
buffers is kept and refreshed only when vLLM writes into them (torch's version counter of the buffers).

Under ``torch.compile`` (vLLM's compiled forward, kept with LoRA unless ``LORA_PIN_VLLM_COMPILE=0``:
:mod:`lora_pin.vllm.seams`), each linear and embedding layer's call is one opaque op,
``lora_pin::vllm_lora_linear_`` or ``lora_pin::vllm_lora_embedding_``, as vLLM's own attention and
dual-stream LoRA ops are: the graph holds the op, the layer's tensors and one constant, the wrapper's
handle (the wrappers of a process are numbered in the order vLLM makes them: one per model); the op's
body finds the layer by its buffers (:func:`layer_key`) and runs the eager path above, reading the
step's metadata that :meth:`update_metadata` prepared. The metadata's
shapes depend on the step's adapters, so tracing through them would bake the first step's into the
graph; behind the op the graph does not depend on them at all, and the outputs are those of the eager
path, bit for bit. ``add_shrink``, ``add_expand`` (fully sharded layers) and ``add_lora_logits`` (the LM
head, outside vLLM's compiled forward) are not made traceable: the seam keeps vLLM eager with
``--fully-sharded-loras``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from lora_pin.ops import (
    KernelMeta,
    expand,
    segments_from_slots,
    shrink,
)
from lora_pin.ops.backends.cpu import CpuDelta
from lora_pin.vllm.dora import DoraSlots, layer_key

if TYPE_CHECKING:
    from vllm.lora.layers import LoRAMapping

__all__ = ["LoraPinPunicaWrapper", "keyed_buffer"]

# The wrappers by handle, for the ops' bodies: a compiled graph holds a wrapper's handle as a constant.
_WRAPPERS: weakref.WeakValueDictionary[int, LoraPinPunicaWrapper] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


class LoraPinPunicaWrapper(PunicaWrapperCPU):
    """A punica wrapper whose layers run lora_pin's ops (see the module).

    vLLM builds it through ``current_platform.get_punica_wrapper()``, with the arguments of
    ``PunicaWrapperBase``; the plugin (:func:`lora_pin.vllm.register`) makes the CPU platform name it.
    It keeps vLLM's own metadata (``token_lora_indices``, ``sampler_indices``; vLLM's embedding layer
    reads them) and adds lora_pin's segments.
    """

    def __init__(
        self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str, **kwargs: Any
    ) -> None:
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        self._slot_ranks: list[int] = []
        # Per slot: the ids of the layers (their first A buffer) its adapter has no weights for.
        self._slot_without: list[frozenset[int]] = []
        # The layers no adapter of the step's slots has weights for (skipped whole).
        self._silent: frozenset[int] = frozenset()
        # Rank and scaling tables by (layer id or None, number of slices, scale), rebuilt when a slot
        # changes.
        self._tables: dict[tuple[int | None, int, float], tuple[torch.Tensor, torch.Tensor]] = {}
        self._token_segments = KernelMeta(*(torch.empty(0, dtype=t) for t in _SEGMENT_DTYPES))
        self._sampler_segments = self._token_segments
        # The step's prepared deltas by the id of the layer's A buffer; per shape (tokens, A's and B's
        # shapes) the last one checked and planned in full, whose plan the next layer group of that shape
        # shares (a model's groups alternate shapes: q/k/v, o, ...); the concatenated copies of fused
        # layers' buffers.
        self._prepared: dict[int, CpuDelta] = {}
        self._shared: dict[tuple[int, torch.Size, torch.Size], CpuDelta] = {}
        self._buffers_of: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}
        # DoRA adapters' factors per linear layer and slot (lora_pin.vllm.dora).
        self.dora = DoraSlots()
        self._handle = next(_HANDLES)
        _WRAPPERS[self._handle] = self

    def set_slot(self, slot: int, n_slots: int, rank: int, without: Iterable[torch.Tensor] = ()) -> None:
        """Records that the adapter vLLM activated into ``slot`` (of ``n_slots``) has ``rank`` (its
        largest rank over modules; ``rank_pattern`` may vary it): only that many columns of the slot's
        buffers are multiplied. ``without``: the buffer each layer the adapter has no weights for is
        known by (:func:`keyed_buffer`), where the slot's rows are not multiplied at all."""
        if len(self._slot_ranks) != n_slots:
            self._slot_ranks = [0] * n_slots
            self._slot_without = [frozenset()] * n_slots
        self._slot_ranks[slot] = rank
        self._slot_without[slot] = frozenset(layer_key(a) for a in without)
        self._tables.clear()
        # Until the next step's update_metadata says which slots are held, no layer is skipped whole.
        self._silent = frozenset()

    def update_metadata(
        self,
        mapping: LoRAMapping,
        lora_index_to_id: list[int | None],
        max_loras: int,
        vocab_size: int,
        **kwargs: Any,
    ) -> None:
        """vLLM's metadata for the step, then lora_pin's segments of its tokens and of its sampled rows."""
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        if len(self._slot_ranks) != len(lora_index_to_id):
            self._slot_ranks = [0] * len(lora_index_to_id)
            self._slot_without = [frozenset()] * len(lora_index_to_id)
            self._tables.clear()
        held = zip(self._slot_without, lora_index_to_id, strict=True)
        used = [without for without, adapter in held if adapter is not None]
        self._silent = frozenset.intersection(*used) if used else frozenset()
        self._token_segments = segments_from_slots(self.token_lora_indices)
        self._sampler_segments = segments_from_slots(self.sampler_indices)
        self.dora.new_step(self._token_segments)
        self._prepared.clear()
        self._shared.clear()

    def _table(
        self, n_slices: int, scale: float, device: torch.device, layer: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot_ranks int32 [slots, n_slices], slot_scalings float32 [slots, n_slices])``; for
        ``layer`` (the id of its first A buffer), rank 0 in the slots whose adapter has no weights there."""
        key = (layer, n_slices, scale)
        table = self._tables.get(key)
        if table is None:
            slot_ranks = self._slot_ranks
            if layer is not None and any(layer in without for without in self._slot_without):
                slot_ranks = [
                    0 if layer in without else rank
                    for rank, without in zip(slot_ranks, self._slot_without, strict=True)
                ]
            ranks = torch.tensor(slot_ranks, dtype=torch.int32, device=device)
            table = (
                ranks[:, None].expand(-1, n_slices).contiguous(),
                torch.full((len(self._slot_ranks), n_slices), scale, dtype=torch.float32, device=device),
            )
            self._tables[key] = table
        return table

    def _buffers(
        self, key: int, lora_a_stacked: tuple[torch.Tensor, ...], lora_b_stacked: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's buffers (``key``: the layer's) as the op takes them: ``a [slots, n*R, in]``,
        ``b [slots, out_total, R]``: views of vLLM's for one slice, kept for good (the step's prepared
        delta is found by them); for several, a copy, refreshed when vLLM has written into its buffers
        since."""
        cached = self._buffers_of.get(key)
        if len(lora_a_stacked) == 1:
            if cached is None:
                cached = ((), lora_a_stacked[0].flatten(1, 2), lora_b_stacked[0].flatten(1, 2))
                self._buffers_of[key] = cached
            return cached[1], cached[2]
        versions = tuple(t._version for t in (*lora_a_stacked, *lora_b_stacked))
        if cached is None or cached[0] != versions:
            a = torch.cat([t.flatten(1, 2) for t in lora_a_stacked], dim=1)
            b = torch.cat([t.flatten(1, 2) for t in lora_b_stacked], dim=1)
            cached = (versions, a, b)
            self._buffers_of[key] = cached
        return cached[1], cached[2]

    def _delta(
        self,
        segments: KernelMeta,
        a: torch.Tensor,
        b: torch.Tensor,
        offsets: tuple[int, ...],
        scale: float,
        n_tokens: int,
        layer: int | None = None,
    ) -> CpuDelta:
        """The step's prepared delta over ``a`` and ``b`` (made on the first layer call of the step);
        ``layer`` as :meth:`_table` takes it."""
        key = id(a)
        prepared = self._prepared.get(key)
        if prepared is None or prepared.a is not a or prepared.n_tokens != n_tokens:
            ranks, scalings = self._table(len(offsets) - 1, scale, a.device, layer)
            meta = KernelMeta.for_layer(segments, ranks, scalings, offsets)
            shape = (n_tokens, a.shape, b.shape)
            like = self._shared.get(shape)
            prepared = CpuDelta.prepare(meta, a, b, n_tokens, like=like)
            if like is None or prepared.plan is not like.plan:
                self._shared[shape] = prepared
            self._prepared[key] = prepared
        return prepared

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        """``y[t, slice i] += scale * x[t] @ A_i[slot(t)]ᵀ @ B_i[slot(t)]ᵀ`` for rows with an adapter;
        ``y`` ``[T, sum(output_slices)]``, ``x`` ``[T, in]``. Rows without one are left untouched.
        Traced by ``torch.compile``: one ``lora_pin::vllm_lora_linear_`` op (see the module)."""
        add_inputs = bool(kwargs.get("add_inputs", True))
        if torch.compiler.is_compiling():
            torch.ops.lora_pin.vllm_lora_linear_(
                y,
                x,
                list(lora_a_stacked),
                list(lora_b_stacked),
                scale,
                list(output_slices),
                add_inputs,
                self._handle,
            )
            return
        self._lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, add_inputs)

    def _lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        add_inputs: bool,
    ) -> None:
        """:meth:`add_lora_linear`'s work, eager (and the body of its op)."""
        if not add_inputs:
            y.zero_()
        layer = layer_key(lora_a_stacked[0])
        if self._token_segments.perm.numel() == 0 or layer in self._silent:
            return
        y2 = y.view(-1, y.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        a, b = self._buffers(layer, lora_a_stacked, lora_b_stacked)
        offsets = (0, *itertools.accumulate(output_slices))
        prepared = self._delta(self._token_segments, a, b, offsets, scale, x2.shape[0], layer)
        if not prepared.empty:
            prepared.apply(y2, x2)
        self.dora.rescale(y2, layer, add_inputs)

    def add_shrink(
        self,
        y: tuple[torch.Tensor, ...] | torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        scale: float,
        **kwargs: Any,
    ) -> None:
        """``y[i][t, :R] = scale * x[t] @ A_i[slot(t)]ᵀ`` (rows without an adapter: 0); the shrink half
        that vLLM's fully sharded layers run before a collective."""
        x2 = x.view(-1, x.shape[-1])
        for i, a_stacked in enumerate(lora_a_stacked):
            a = a_stacked.flatten(1, 2)
            ranks, _ = self._table(1, 1.0, a.device)
            meta = KernelMeta(*self._token_segments[:3], slot_ranks=ranks, n_slices=1)
            v = shrink(x2.to(a.dtype), a, meta)
            y[i][:, : v.shape[1]] = v * scale

    def add_expand(
        self,
        y: torch.Tensor,
        x: tuple[torch.Tensor, ...] | torch.Tensor,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """``y[t, offset_i : offset_i + out_i] += x[i][t] @ B_i[slot(t)]ᵀ`` for rows with an adapter; the
        expand half of vLLM's fully sharded layers."""
        y2 = y.view(-1, y.shape[-1])
        if not add_inputs:
            y2.zero_()
        offset = offset_start
        for i, b_stacked in enumerate(lora_b_stacked):
            b = b_stacked.flatten(1, 2)
            ranks, scalings = self._table(1, 1.0, b.device)
            meta = KernelMeta.for_layer(self._token_segments, ranks, scalings, (0, output_slices[i]))
            part = torch.zeros((y2.shape[0], output_slices[i]), dtype=b.dtype, device=b.device)
            expand(part, x[i].to(b.dtype).contiguous(), b, meta)
            y2[:, offset : offset + output_slices[i]] += part.to(y2.dtype)
            offset += output_slices[i]

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """``y[t] += x[t] @ B[slot(t)]ᵀ`` for rows with an adapter: an embedding's LoRA, whose shrink is
        the lookup vLLM's layer has done (``x`` ``[T, R]``, ``y`` ``[T, dim]``). Traced by
        ``torch.compile``: one ``lora_pin::vllm_lora_embedding_`` op (see the module)."""
        if torch.compiler.is_compiling():
            torch.ops.lora_pin.vllm_lora_embedding_(y, x, lora_b_stacked, add_inputs, self._handle)
            return
        self._lora_embedding(y, x, lora_b_stacked, add_inputs)

    def _lora_embedding(
        self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, add_inputs: bool
    ) -> None:
        """:meth:`add_lora_embedding`'s work, eager (and the body of its op)."""
        if not add_inputs:
            y.zero_()
        layer = layer_key(lora_b_stacked)
        if self._token_segments.perm.numel() == 0 or layer in self._silent:
            return
        b = lora_b_stacked.flatten(1, 2)
        ranks, scalings = self._table(1, 1.0, b.device, layer)
        meta = KernelMeta.for_layer(self._token_segments, ranks, scalings, (0, b.shape[1]))
        expand(y, x.to(b.dtype).contiguous(), b, meta)

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """``y[s, :V] += scale * x[s] @ A[slot(s)]ᵀ @ B[slot(s)]ᵀ`` for sampled rows with an adapter
        (``lm_head`` LoRA; ``y`` ``[S, V']`` logits, ``V' >= V`` with vLLM's padding)."""
        if self._sampler_segments.perm.numel() == 0:
            return
        y2 = y.view(-1, y.shape[-1])
        x2 = x.view(-1, x.shape[-1])
        a = lora_a_stacked.flatten(1, 2)
        b = lora_b_stacked.flatten(1, 2)
        vocab = b.shape[1]
        out = y2[:, :vocab].contiguous() if y2.shape[1] != vocab else y2
        prepared = self._delta(self._sampler_segments, a, b, (0, vocab), scale, x2.shape[0])
        if not prepared.empty:
            prepared.apply(out, x2.to(a.dtype))
        if out is not y2:
            y2[:, :vocab] = out


_SEGMENT_DTYPES = (torch.int64, torch.int32, torch.int32)


def keyed_buffer(module: Any) -> torch.Tensor | None:
    """The buffer of a vLLM LoRA layer by which the wrapper knows the layer (:func:`layer_key`): a linear
    layer's first A buffer (``lora_a_stacked[0]``), a token embedding's B buffer (the one its
    :meth:`~LoraPinPunicaWrapper.add_lora_embedding` call gets); None for other layers (the LM head's
    LoRA is multiplied in every slot)."""
    from vllm.lora.layers import VocabParallelEmbeddingWithLoRA

    stacked = getattr(module, "lora_a_stacked", None)
    if isinstance(stacked, tuple):
        return stacked[0]
    if isinstance(module, VocabParallelEmbeddingWithLoRA):
        return module.lora_b_stacked
    return None


def _wrapper(handle: int) -> LoraPinPunicaWrapper:
    wrapper = _WRAPPERS.get(handle)
    if wrapper is None:
        raise RuntimeError(f"lora_pin: no punica wrapper has handle {handle} in this process")
    return wrapper


def _lora_linear_op(
    y: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    scale: float,
    output_slices: list[int],
    add_inputs: bool,
    wrapper: int,
) -> None:
    _wrapper(wrapper)._lora_linear(y, x, tuple(a), tuple(b), scale, tuple(output_slices), add_inputs)


def _lora_embedding_op(
    y: torch.Tensor, x: torch.Tensor, b: torch.Tensor, add_inputs: bool, wrapper: int
) -> None:
    _wrapper(wrapper)._lora_embedding(y, x, b, add_inputs)


def _no_output(*args: Any) -> None:
    # The fake body: the ops only add into ``y`` in place.
    return None


# Defined at the dispatcher's level (a schema, a body, a fake body), as lora_pin.ops.library's ops are.
for _name, _schema, _body in (
    (
        "vllm_lora_linear_",
        "(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, float scale, int[] output_slices, "
        "bool add_inputs, int wrapper) -> ()",
        _lora_linear_op,
    ),
    (
        "vllm_lora_embedding_",
        "(Tensor(a!) y, Tensor x, Tensor b, bool add_inputs, int wrapper) -> ()",
        _lora_embedding_op,
    ),
):
    torch.library.define(f"lora_pin::{_name}", _schema)
    torch.library.impl(f"lora_pin::{_name}", "default")(_body)
    torch.library.register_fake(f"lora_pin::{_name}")(_no_output)
