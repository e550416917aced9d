"""The torch-ops backend: every layer's work through the registered ``lora_pin::`` ops.

What ``torch.compile`` traces (the ops' fake bodies give it shapes, and nothing reads the segment arrays
on the host, so the graph has no data-dependent break), what the other backends hand their work to while
traced, and what devices without a backend of their own run (the ops' torch bodies). Nothing is kept
between calls: under ``torch.compile`` the graph is built once and replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lora_pin.ops.backends.base import LoRABackend, SplitDelta, StepRows, embed_scale_tensor
from lora_pin.ops.backends.paged import REGISTERED_PAGED_OPS, PagedOps, paged_linear, paged_split
from lora_pin.ops.custom_ops import expand, shrink
from lora_pin.ops.dora import dora_scale_
from lora_pin.ops.segments import KernelMeta
from lora_pin.weights.pool import GroupBuffers

__all__ = ["TorchOpsBackend"]


class TorchOpsBackend(LoRABackend):
    """Every layer's work as calls of ``lora_pin::shrink``, ``::expand`` and ``::dora_scale_`` (a paged
    group's as :attr:`paged_ops`)."""

    @property
    def paged_ops(self) -> PagedOps:
        """The paged shrink and expand this backend runs (:data:`REGISTERED_PAGED_OPS`)."""
        return REGISTERED_PAGED_OPS

    def add_lora_linear(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        out: torch.Tensor,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        dora_bias: Callable[[], torch.Tensor | None],
    ) -> None:
        seg = step.for_input(x)
        flat_out = out.view(-1, out.shape[-1])
        if buffers.page_rank is not None:
            paged_linear(self.paged_ops, step, buffers, out, x, slice_offsets)
        else:
            meta = self.meta(step, buffers, seg, slice_offsets)
            expand(flat_out, shrink(x.reshape(-1, x.shape[-1]), buffers.a, meta), buffers.b, meta)
        if self.rescales_dora(buffers, x):
            rows = self.dora_rows(step, buffers, x, seg)
            assert buffers.factors is not None and buffers.dora is not None
            # Every adapter row: the op keeps the DoRA slots' rows by their flags.
            dora_scale_(flat_out, dora_bias(), buffers.factors, buffers.dora, *rows)

    def add_lora_embedding(
        self, step: StepRows, buffers: GroupBuffers, out: torch.Tensor, ids: torch.Tensor, embed_scale: object
    ) -> None:
        # The step's rows are the tokens; the output ([..., dim]) has the shape a linear's input would.
        seg = step.for_input(out)
        meta = self.meta(step, buffers, seg, buffers.slice_offsets)
        flat_ids = ids.reshape(-1)
        perm = seg.perm
        # Each adapter row's slot, from its segment's (a skipped segment's -1 reads slot 0: expand skips
        # that segment). output_size keeps the shape known without a device-to-host read.
        counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
        row_slots = torch.repeat_interleave(
            seg.seg_slots.long().clamp_min(0), counts, output_size=perm.shape[0]
        )
        looked_up = buffers.a[row_slots, :, flat_ids.index_select(0, perm)]
        scale = embed_scale_tensor(embed_scale, out)
        if scale is not None:
            # A scaled embedding (Gemma's) scales its output in its forward; PEFT scales the delta alike.
            looked_up = looked_up * scale
        v = out.new_zeros((flat_ids.shape[0], buffers.a.shape[1]))
        v.index_copy_(0, perm, looked_up)
        expand(out.view(-1, out.shape[-1]), v, buffers.b, meta)

    def split_delta(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        shrink_ranks: Callable[[], torch.Tensor] | None,
    ) -> SplitDelta:
        if buffers.page_rank is not None:
            return paged_split(self.paged_ops, step, buffers, x, slice_offsets, shrink_ranks)
        meta = self.meta(step, buffers, step.for_input(x), slice_offsets)
        local = meta if shrink_ranks is None else meta._replace(slot_ranks=shrink_ranks())
        return _OpsSplit(buffers.a, buffers.b, local, meta)

    def meta(
        self, step: StepRows, buffers: GroupBuffers, seg: KernelMeta, slice_offsets: Sequence[int]
    ) -> KernelMeta:
        """The kernel meta of ``seg`` (the step's segments for a layer's input) in ``buffers``' group."""
        return KernelMeta.for_layer(seg, buffers.ranks, buffers.scalings, slice_offsets)

    def rescales_dora(self, buffers: GroupBuffers, x: torch.Tensor) -> bool:
        """Whether a layer rescales its group's DoRA rows: while a DoRA adapter sits in its slots, and,
        for a pool that can hold DoRA, always when traced by ``torch.compile``: a compiled step must
        not depend on ``dora_slots``, which a later load changes while the flags change in place."""
        return buffers.dora_slots is not None and (bool(buffers.dora_slots) or torch.compiler.is_compiling())

    def dora_rows(
        self, step: StepRows, buffers: GroupBuffers, x: torch.Tensor, seg: KernelMeta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every adapter row of ``seg`` (int64 ``[N]``) and its slot (int32 ``[N]``): the rows
        ``lora_pin::dora_scale_`` considers, keeping those of DoRA slots by their flags (no read of the
        arrays from the host)."""
        counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
        row_slots = torch.repeat_interleave(seg.seg_slots, counts, output_size=seg.perm.shape[0])
        return seg.perm, row_slots


class _OpsSplit(SplitDelta):
    """A group's shrink and expand as ``lora_pin::shrink`` and ``lora_pin::expand`` calls."""

    __slots__ = ("_a", "_b", "_expand_meta", "_shrink_meta")

    def __init__(
        self, a: torch.Tensor, b: torch.Tensor, shrink_meta: KernelMeta, expand_meta: KernelMeta
    ) -> None:
        self._a, self._b = a, b
        self._shrink_meta, self._expand_meta = shrink_meta, expand_meta

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        return shrink(x, self._a, self._shrink_meta)

    def expand(self, out: torch.Tensor, v: torch.Tensor) -> None:
        expand(out, v, self._b, self._expand_meta)
