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

from lora_pin.errors import SpecError
from lora_pin.model.segments import StepSegments
from lora_pin.ops import (
    KernelMeta,
    OpArgumentError,
    SegmentBatch,
    dora_scale_,
    expand,
    shrink,
)
from lora_pin.ops.dora import scale_rows_
from lora_pin.weights.pool import GroupBuffers

__all__ = ["BaseLayerWrapper", "LoRAEmbedding", "LoRALinear"]


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
