"""LoRA layers: wrappers around a model's target linears that add every row's adapter delta.

A :class:`LoRALinear` keeps the base layer untouched and, while a step is active, adds
``scaling * B[slot] (A[slot] x)`` to each row whose request uses an adapter, over the device pool's
buffers, through the model's backend (:mod:`lora_pin.ops.backends`, chosen once for the pool's device:
the layers never look at the device); a row of a DoRA adapter is then rescaled by its factor around
the bias (:mod:`lora_pin.weights.dora`). Rows with no adapter are never touched, so they
equal the base model's output bit for bit. With no active step the wrapper is the base layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lora_pin.errors import SpecError
from lora_pin.model.segments import StepSegments
from lora_pin.ops import KernelMeta, OpArgumentError
from lora_pin.ops.backends import LoRABackend, backend_for
from lora_pin.weights.pool import GroupBuffers

__all__ = ["BaseLayerWrapper", "LoRAEmbedding", "LoRALinear"]


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
    How the delta is computed is the backend's (:mod:`lora_pin.ops.backends`), chosen once per model.

    Args:
        base_layer: the wrapped linear (kept as is; its weights are never modified); output width
            ``buffers.group.out_total``.
        buffers: the device pool's buffers of this layer's group.
        active_step: returns the active :class:`StepSegments`, or None outside a step.
        returns_bias: ``base_layer`` returns ``(out, bias)`` (see :func:`lora_pin.register_linear`); the
            wrapper then returns the same pair, the delta added to ``out``.
        key: the module's key in the model, for errors.
        backend: runs the delta; the model's layers share one (default: a new one for the device of
            ``buffers``, :func:`lora_pin.ops.backends.backend_for`).

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
        backend: LoRABackend | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self._returns_bias = returns_bias
        self._key = key
        self._pool_buffers = buffers
        self._active_step = active_step
        self._backend = backend_for(buffers.a.device) if backend is None else backend
        self._n_slices = buffers.group.n_slices
        # Where each slice's columns start and end in the output: a tensor-parallel shard has its own.
        self._offsets: Sequence[int] = buffers.slice_offsets

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
        self._check_dtypes(x, out)
        self._backend.add_lora_linear(step, self._pool_buffers, out, x, self._offsets, self._dora_bias)
        return result

    def _check_dtypes(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Refuse an input, or (for a pool that holds DoRA factors, which rescale it) an output, of
        another dtype than the pool's.

        Raises:
            OpArgumentError: as :meth:`_check_dtype`.
        """
        pool = self._pool_buffers.a.dtype
        if x.dtype is not pool:
            self._check_dtype("the input", x.dtype, ", or is autocast on (not supported)")
        if out.dtype is not pool and self._pool_buffers.dora_slots:
            self._check_dtype("the layer output", out.dtype)

    def _dora_bias(self) -> torch.Tensor | None:
        """The bias in ``out`` that a DoRA row is rescaled around (``[out]``), or None."""
        bias = None if self._returns_bias else getattr(self.base_layer, "bias", None)
        return None if bias is None else bias.detach()

    def _untouched(self, result: Any, seg: KernelMeta) -> Any:
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

    Args:
        base_layer: the wrapped ``nn.Embedding`` (or subclass); kept as is. A one-element ``embed_scale``
            attribute (Gemma's scaled embedding) scales the delta too, as PEFT does.
        buffers: the device pool's buffers of this embedding's group (one slice).
        active_step: returns the active :class:`StepSegments`, or None outside a step.
        backend: as for :class:`LoRALinear`.
    """

    def forward(self, x: torch.Tensor) -> Any:
        """Token ids ``[...]`` -> ``[..., dim]``: the base embeddings plus the step's adapter deltas."""
        out = self.base_layer(x)
        step = self._active_step()
        if step is None or not step.any_adapter:
            return out
        if out.dtype is not self._pool_buffers.a.dtype:
            self._check_dtype("the embedding output", out.dtype)
        embed_scale = getattr(self.base_layer, "embed_scale", None)
        self._backend.add_lora_embedding(step, self._pool_buffers, out, x, embed_scale)
        return out
