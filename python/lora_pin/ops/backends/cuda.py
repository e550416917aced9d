"""The CUDA backend: the Triton SGMV kernels through the registered ops, capturable into a CUDA graph.

Every call is what :class:`~lora_pin.ops.backends.fallback.TorchOpsBackend` makes (the ops' CUDA bodies
launch the Triton kernels and never read the segment arrays on the host, so a step can be captured); on
top, a DoRA pool's rows are rescaled whenever a graph is being captured, since a DoRA adapter loaded
after the capture must find the rescale in the graph; and an eager step's DoRA rows (per input shape)
and a fully sharded layer's chunk ranks (per group and input shape) are made once per step instead of
once per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lora_pin.ops.backends.base import SplitDelta, StepRows
from lora_pin.ops.backends.fallback import TorchOpsBackend
from lora_pin.ops.backends.paged import PagedOps, triton_paged_ops
from lora_pin.ops.segments import KernelMeta
from lora_pin.weights.pool import GroupBuffers

__all__ = ["CudaBackend"]


class CudaBackend(TorchOpsBackend):
    """The LoRA layers' work on CUDA tensors (see the module)."""

    def __init__(self) -> None:
        # The last eager step's DoRA rows by input shape, and its splits by group (A's identity, which
        # the split holds) and input shape; replaced when another step comes.
        self._step: StepRows | None = None
        self._dora_rows: dict[torch.Size, tuple[torch.Tensor, torch.Tensor]] = {}
        self._splits: dict[tuple[int, torch.Size], SplitDelta] = {}
        self._paged_ops: PagedOps | None = None

    @property
    def paged_ops(self) -> PagedOps:
        """The Triton paged kernels (:mod:`lora_pin.ops.triton_paged`)."""
        if self._paged_ops is None:
            self._paged_ops = triton_paged_ops()
        return self._paged_ops

    def _of_step(self, step: StepRows) -> None:
        if step is not self._step:
            self._step, self._dora_rows, self._splits = step, {}, {}

    def rescales_dora(self, buffers: GroupBuffers, x: torch.Tensor) -> bool:
        if buffers.dora_slots is None:
            return False
        if buffers.dora_slots or torch.compiler.is_compiling():
            return True
        return x.is_cuda and torch.cuda.is_current_stream_capturing()

    def dora_rows(
        self, step: StepRows, buffers: GroupBuffers, x: torch.Tensor, seg: KernelMeta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return super().dora_rows(step, buffers, x, seg)
        self._of_step(step)
        key = x.shape[:-1]
        rows = self._dora_rows.get(key)
        if rows is None:
            rows = self._dora_rows[key] = super().dora_rows(step, buffers, x, seg)
        return rows

    def split_delta(
        self,
        step: StepRows,
        buffers: GroupBuffers,
        x: torch.Tensor,
        slice_offsets: Sequence[int],
        shrink_ranks: Callable[[], torch.Tensor] | None,
    ) -> SplitDelta:
        if torch.compiler.is_compiling():
            return super().split_delta(step, buffers, x, slice_offsets, shrink_ranks)
        self._of_step(step)
        key = (id(buffers.a), x.shape[:-1])
        split = self._splits.get(key)
        if split is None:
            split = self._splits[key] = super().split_delta(step, buffers, x, slice_offsets, shrink_ranks)
        return split
