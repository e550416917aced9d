"""A paged pool's LoRA work (:class:`~lora_pin.weights.PagedDevicePool`), shared by every backend: the
shrink and expand read A and B through the step's page tables (:attr:`StepRows.pages`).

The paged ops a backend runs per call are named here and nowhere else (:class:`PagedOps`): the
registered-ops backend's (:data:`REGISTERED_PAGED_OPS`, the ``lora_pin::paged_shrink`` /
``::paged_expand`` custom ops, whose fake bodies ``torch.compile`` traces) and the Triton kernels on
CUDA (:func:`triton_paged_ops`). The CPU backend instead plans each group once per step
(:mod:`lora_pin.ops.backends.cpu_paged`), reading the step's page tables by :func:`step_pages`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from lora_pin.errors import OpArgumentError
from lora_pin.ops.backends.base import SplitDelta, StepRows
from lora_pin.ops.paged import PageTable
from lora_pin.ops.paged_ops import paged_expand, paged_shrink
from lora_pin.ops.segments import KernelMeta
from lora_pin.weights.pool import GroupBuffers

__all__ = [
    "REGISTERED_PAGED_OPS",
    "PagedOps",
    "PagedSplit",
    "paged_linear",
    "paged_split",
    "step_pages",
    "triton_paged_ops",
]


class PagedOps(NamedTuple):
    """The paged shrink and expand a backend runs, with :func:`lora_pin.ops.paged_torch.paged_shrink_torch`'s
    and :func:`~lora_pin.ops.paged_torch.paged_expand_torch`'s signatures:

    - ``shrink(x [T, in], a_pages, pages, meta, max_rank) -> v [T, n_slices * max_rank]``;
    - ``expand(out [T, out_total], v, b_pages, pages, meta)``, in place.
    """

    shrink: Callable[[torch.Tensor, torch.Tensor, PageTable, KernelMeta, int], torch.Tensor]
    expand: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PageTable, KernelMeta], None]


#: The registered-ops backend's (what torch.compile traces and devices without a backend run): the
#: ``lora_pin::paged_shrink`` / ``::paged_expand`` custom ops.
REGISTERED_PAGED_OPS = PagedOps(paged_shrink, paged_expand)


def triton_paged_ops() -> PagedOps:
    """The Triton paged kernels (:mod:`lora_pin.ops.triton_paged`), imported on first use: Triton is only
    there where CUDA is."""
    from lora_pin.ops.triton_paged import paged_expand, paged_shrink

    return PagedOps(paged_shrink, paged_expand)


def step_pages(step: StepRows, buffers: GroupBuffers) -> PageTable:
    """The step's page tables for a paged group.

    Raises:
        OpArgumentError: the step carries none, or of another ``page_rank`` than the group's.
    """
    pages = getattr(step, "pages", None)
    if pages is None or pages.page_rank != buffers.page_rank:
        raise OpArgumentError(
            f"group {buffers.group.key!r} is paged (page_rank={buffers.page_rank}) but the step carries "
            f"{'no page tables' if pages is None else f'page tables of page_rank={pages.page_rank}'}"
        )
    return pages


def _max_rank(buffers: GroupBuffers) -> int:
    assert buffers.max_rank is not None, "a paged group has its max rank"
    return buffers.max_rank


def paged_linear(
    ops: PagedOps,
    step: StepRows,
    buffers: GroupBuffers,
    out: torch.Tensor,
    x: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """``out [..., out_total] += delta(x [..., in])`` in place over a paged group, by ``ops`` (DoRA's
    rescale is the caller's, as for slots).

    Raises:
        UsageError: as :meth:`StepRows.for_input`.
        OpArgumentError: as :func:`step_pages`, or what ``ops`` refuse.
    """
    pages = step_pages(step, buffers)
    meta = KernelMeta.for_layer(step.for_input(x), buffers.ranks, buffers.scalings, slice_offsets)
    v = ops.shrink(x.reshape(-1, x.shape[-1]), buffers.a, pages, meta, _max_rank(buffers))
    ops.expand(out.view(-1, out.shape[-1]), v, buffers.b, pages, meta)


def paged_split(
    ops: PagedOps,
    step: StepRows,
    buffers: GroupBuffers,
    x: torch.Tensor,
    slice_offsets: Sequence[int],
    shrink_ranks: Callable[[], torch.Tensor] | None,
) -> PagedSplit:
    """A paged group's shrink and expand for input ``x``, to run apart (see ``LoRABackend.split_delta``).

    Raises:
        UsageError, OpArgumentError: as :func:`paged_linear`.
    """
    pages = step_pages(step, buffers)
    meta = KernelMeta.for_layer(step.for_input(x), buffers.ranks, buffers.scalings, slice_offsets)
    local = meta if shrink_ranks is None else meta._replace(slot_ranks=shrink_ranks())
    return PagedSplit(ops, buffers, pages, local, meta)


class PagedSplit(SplitDelta):
    """A paged group's shrink and expand by ``ops``, run apart."""

    __slots__ = ("_buffers", "_expand_meta", "_ops", "_pages", "_shrink_meta")

    def __init__(
        self,
        ops: PagedOps,
        buffers: GroupBuffers,
        pages: PageTable,
        shrink_meta: KernelMeta,
        expand_meta: KernelMeta,
    ) -> None:
        self._ops, self._buffers, self._pages = ops, buffers, pages
        self._shrink_meta, self._expand_meta = shrink_meta, expand_meta

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return self._ops.shrink(x, buffers.a, self._pages, self._shrink_meta, _max_rank(buffers))

    def expand(self, out: torch.Tensor, v: torch.Tensor) -> None:
        self._ops.expand(out, v, self._buffers.b, self._pages, self._expand_meta)
