"""The interface every backend implements: how one step's LoRA work runs in the layers, per device.

A LoRA layer hands its backend the step, its pool group's buffers and its tensors; the backend decides
how the work runs (vLLM's ``punica_wrapper``: one small interface, one file per device, chosen once).
The layers never look at the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from lora_pin.ops.experts import ExpertMeta, expert_lora_delta_
from lora_pin.ops.segments import KernelMeta
from lora_pin.weights.pool import GroupBuffers

__all__ = ["LoRABackend", "SplitDelta", "StepRows"]


class StepRows(Protocol):
    """What a backend reads of the active step (``lora_pin.model.StepSegments``): its segments, and for a
    paged pool (``GroupBuffers.page_rank`` set) its ``pages`` attribute, the step's page tables
    (:class:`lora_pin.ops.paged.PageTable`), read only for paged groups."""

    def for_input(self, x: torch.Tensor) -> KernelMeta:
        """The segments of layer input ``x`` (``[..., in]``; raises ``UsageError`` for a wrong shape)."""
        ...


class SplitDelta(ABC):
    """A layer group's shrink and expand for one step, run apart (a collective between them: a fully
    sharded tensor-parallel layer); made by :meth:`LoRABackend.split_delta`."""

    @abstractmethod
    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """``v [T, n_slices * R]`` of ``x [T, in]`` over the A (and ranks) the split was made with."""

    @abstractmethod
    def expand(self, out: torch.Tensor, v: torch.Tensor) -> None:
        """``out [T, out_total] += scaling * v B[slot]ᵀ`` per slice, in place (``out`` may be a strided
        column slice); rows of no adapter keep their values bit for bit."""


class LoRABackend(ABC):
    """How a device runs the LoRA layers' work; one instance serves every layer of a model.

    Every method takes the active step and the layer's pool group buffers (``a``
    ``[slots, n_slices * R, in]``, ``b`` ``[slots, out_total, R]``, ranks and scalings
    ``[slots, n_slices]``; a paged group's ``a_pages`` and ``b_pages``, run through
    :mod:`lora_pin.ops.backends.paged` over the step's page tables), and tensors with any leading shape
    (``[T, ...]`` packed, ``[B, L, ...]`` per sequence), of the pool's dtype (the layers check it).

    Raises (every method):
        UsageError: the input does not have the step's shape (:meth:`StepRows.for_input`).
        OpArgumentError: what the ``lora_pin`` ops refuse (shapes, dtypes, devices, segment contents).
    """

    @abstractmethod
    def add_lora_linear(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        out: torch.Tensor,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        dora_bias: Callable[[], torch.Tensor | None],
    ) -> None:
        """``out [..., out_total] += delta(x [..., in])`` in place, then each DoRA row rescaled by its
        factor around ``dora_bias()`` (``[out_total]`` or None, read only when a row is rescaled).

        ``slice_offsets``: ``n_slices + 1`` column offsets of the slices in ``out``."""

    @abstractmethod
    def add_lora_embedding(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        out: torch.Tensor,
        ids: torch.Tensor,
        embed_scale: object,
    ) -> None:
        """``out [..., dim] += scaling * B[slot] A[slot][:, id]`` for each adapter token of ``ids
        [...]`` in place; ``embed_scale``: a scaled embedding's one-element factor (Gemma's, applied
        to the delta as PEFT does), anything else for none."""

    @abstractmethod
    def split_delta(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        shrink_ranks: Callable[[], torch.Tensor] | None,
    ) -> SplitDelta | None:
        """The shrink and expand of ``buffers``' group for input ``x``, to run apart, or None when the
        backend knows that no row of the step uses the group (read from the group's full ranks, the
        same on every process of a tensor-parallel group, so all skip the collective together).

        Args:
            slice_offsets: the slices' columns in the expand's output.
            shrink_ranks: returns the int32 ``[slots, n_slices]`` ranks of ``buffers.a``'s rows when they
                are not the group's (a fully sharded column layer's chunk of each slot's rank).
        """

    def add_expert_lora(
        self, buffers: GroupBuffers, out: torch.Tensor, x: torch.Tensor, segments: KernelMeta
    ) -> None:
        """``out [R, out] += scaling * B[slot, e] (A[slot, e] x)`` in place for each routed row of ``x
        [R, in]`` whose segment's flat slot is ``slot * E + e``, over an experts group's buffers (``a``
        ``[slots, E * R_max, in]``, ``b`` ``[slots, E * out, R_max]``, ranks and scalings ``[slots, E]``).

        ``segments``: the rows grouped by ``(slot, expert)``
        (:func:`lora_pin.ops.experts.expert_segments`). Every backend runs it as the registered
        ``lora_pin::shrink`` and ``::expand`` over the ``slots * E`` one-slice view of the buffers (their
        CPU and CUDA bodies pick the kernels).

        Raises:
            OpArgumentError: as :func:`lora_pin.ops.experts.expert_lora_delta_`.
        """
        width = buffers.group.members[0].out_features
        meta = ExpertMeta.for_group(segments, buffers.ranks, buffers.scalings, width)
        expert_lora_delta_(out, x, buffers.a, buffers.b, meta)

    def dense_expert_lora(
        self, buffers: GroupBuffers, x: torch.Tensor, slots: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        """The expert LoRA delta ``[E, N, out]`` of ``x [E, N, in]`` (a dense experts module's rows: every
        token once per expert), token ``n`` with the adapter in ``slots[n]`` (int64 ``[N]``, each a
        slot), over an experts group's buffers (as :meth:`add_expert_lora`). One batched GEMM pair per
        slot: a dense module sends every token through every expert."""
        n_experts = buffers.ranks.shape[1]
        delta = x.new_zeros((n_experts, x.shape[1], out_features))
        for slot in torch.unique(slots).tolist():
            rows = (slots == slot).nonzero().squeeze(1)
            a = buffers.a[slot].view(n_experts, -1, x.shape[-1])  # [E, R, in]
            b = buffers.b[slot].view(n_experts, out_features, -1)  # [E, out, R]
            scaling = buffers.scalings[slot].to(x.dtype).view(n_experts, 1, 1)
            shrunk = torch.bmm(x.index_select(1, rows), a.transpose(1, 2))
            delta.index_copy_(1, rows, torch.bmm(shrunk, b.transpose(1, 2)) * scaling)
        return delta


def embed_scale_tensor(embed_scale: object, like: torch.Tensor) -> torch.Tensor | None:
    """A scaled embedding's one-element ``embed_scale`` in ``like``'s dtype and device, or None."""
    if isinstance(embed_scale, (int, float)) or (
        isinstance(embed_scale, torch.Tensor) and embed_scale.numel() == 1
    ):
        return torch.as_tensor(embed_scale, dtype=like.dtype, device=like.device)
    return None
