"""Every ``lora_pin::`` torch op, registered from one table: a name, a schema, and a body per device.

The bodies take the step's segments as one :class:`KernelMeta`; torch.library has no type for it, so the
schemas spell its fields out (``perm``, ``seg_indptr``, ``seg_slots``, ``slot_ranks``, then ``n_slices``
for a shrink, or ``slot_scalings`` and ``slice_offsets`` for anything that expands) and the registration
gathers them back into one meta before a body runs. Every device runs the default body (torch, and the
native CPU kernels where they apply) unless it has its own: CUDA runs the Triton kernels.

Most ops are defined at the dispatcher's level (a schema and one kernel per device), not through
``torch.library.custom_op``, whose Python wrapper costs more than the rest of a small call; shrink,
whose output callers hand on (to expand), takes custom_op's autograd guard (:attr:`OpSpec.custom_op`).
Each has a fake body, so ``torch.compile`` traces through it and ``torch.library.opcheck`` passes. They
are for inference: no autograd formula is registered (the faces refuse tensors that require grad).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lora_pin.ops.custom_ops import (
    expand_cuda,
    expand_fake,
    expand_torch,
    lora_delta_cuda,
    lora_delta_fake,
    lora_delta_torch,
    shrink_cuda,
    shrink_fake,
    shrink_torch,
)
from lora_pin.ops.dora import dora_scale_cuda, dora_scale_fake, dora_scale_torch
from lora_pin.ops.embedding import embedding_delta_fake, embedding_delta_torch
from lora_pin.ops.paged_ops import (
    paged_expand_cuda,
    paged_expand_default,
    paged_expand_fake,
    paged_shrink_cuda,
    paged_shrink_default,
    paged_shrink_fake,
)
from lora_pin.ops.segments import KernelMeta

__all__ = ["OPS", "OpSpec"]

_SEGMENTS = "Tensor perm, Tensor seg_indptr, Tensor seg_slots, Tensor slot_ranks"
# A paged pool's page tables (lora_pin.ops.paged), after its weights and before the meta.
_PAGES = "Tensor page_indptr, Tensor page_table, int page_rank"


def _shrink_meta(
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    n_slices: int,
) -> KernelMeta:
    return KernelMeta(perm, seg_indptr, seg_slots, slot_ranks, n_slices)


def _expand_meta(
    perm: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slice_offsets: Sequence[int],
) -> KernelMeta:
    offsets = tuple(slice_offsets)
    return KernelMeta(perm, seg_indptr, seg_slots, slot_ranks, len(offsets) - 1, slot_scalings, offsets)


@dataclass(frozen=True)
class MetaArgs:
    """How a schema spells a :class:`KernelMeta`: its text and the function that gathers its arguments."""

    schema: str
    gather: Callable[..., KernelMeta]
    count: int


#: A shrink's meta: the segments, the ranks and ``n_slices``.
SHRINK_META = MetaArgs(f"{_SEGMENTS}, int n_slices", _shrink_meta, 5)
#: An expand's meta: the segments, the ranks, the scalings and the slice offsets.
EXPAND_META = MetaArgs(f"{_SEGMENTS}, Tensor slot_scalings, int[] slice_offsets", _expand_meta, 6)


@dataclass(frozen=True)
class OpSpec:
    """One op of the table.

    ``before`` and ``after`` are the schema's arguments around the meta (``meta`` None: the op takes
    none, and ``before`` is all of them); each body takes ``(*before, meta, *after)`` as Python values.
    ``default`` runs on every device without a body of its own (``cuda`` None: CUDA too).
    ``custom_op``: registered through ``torch.library.custom_op``, so an output computed from inputs
    that require grad requires grad itself and its backward raises (shrink's ``v`` then reaches expand,
    whose face refuses it); the faces of the other ops refuse such inputs up front.
    """

    name: str
    before: str
    returns: str
    default: Callable[..., Any]
    fake: Callable[..., Any]
    cuda: Callable[..., Any] | None = None
    meta: MetaArgs | None = None
    after: str = ""
    custom_op: bool = False

    @property
    def schema(self) -> str:
        parts = [self.before, self.meta.schema if self.meta is not None else "", self.after]
        return f"({', '.join(p for p in parts if p)}) -> {self.returns}"

    def body(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as the dispatcher calls it: with the meta's arguments gathered into one."""
        meta = self.meta
        if meta is None:
            return fn
        lead = len(self.before.split(","))

        def flat(*args: Any) -> Any:
            return fn(*args[:lead], meta.gather(*args[lead : lead + meta.count]), *args[lead + meta.count :])

        flat.__name__ = f"{self.name}_{fn.__name__}"
        return flat


OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "shrink",
        "Tensor x, Tensor a",
        "Tensor",
        shrink_torch,
        shrink_fake,
        shrink_cuda,
        SHRINK_META,
        custom_op=True,
    ),
    OpSpec(
        "expand",
        "Tensor(a!) out, Tensor v, Tensor b",
        "()",
        expand_torch,
        expand_fake,
        expand_cuda,
        EXPAND_META,
    ),
    OpSpec(
        "lora_delta_",
        "Tensor(a!) out, Tensor x, Tensor a, Tensor b",
        "()",
        lora_delta_torch,
        lora_delta_fake,
        lora_delta_cuda,
        EXPAND_META,
    ),
    OpSpec(
        "embedding_delta_",
        "Tensor(a!) out, Tensor ids, Tensor a, Tensor b",
        "()",
        embedding_delta_torch,
        embedding_delta_fake,
        meta=EXPAND_META,
        after="float scale=1.0",
    ),
    OpSpec(
        "paged_shrink",
        f"Tensor x, Tensor a_pages, {_PAGES}",
        "Tensor",
        paged_shrink_default,
        paged_shrink_fake,
        paged_shrink_cuda,
        SHRINK_META,
        after="int max_rank",
        custom_op=True,
    ),
    OpSpec(
        "paged_expand",
        f"Tensor(a!) out, Tensor v, Tensor b_pages, {_PAGES}",
        "()",
        paged_expand_default,
        paged_expand_fake,
        paged_expand_cuda,
        EXPAND_META,
    ),
    OpSpec(
        "dora_scale_",
        "Tensor(a!) out, Tensor? bias, Tensor factors, Tensor dora, Tensor rows, Tensor row_slots",
        "()",
        dora_scale_torch,
        dora_scale_fake,
        dora_scale_cuda,
    ),
)


def _register(ops: Sequence[OpSpec]) -> None:
    for op in ops:
        name = f"lora_pin::{op.name}"
        if op.custom_op:
            mutated = [arg.split()[-1] for arg in op.before.split(",") if "!" in arg]
            defined = torch.library.custom_op(
                name, op.body(op.default), mutates_args=mutated, schema=op.schema
            )
            if op.cuda is not None:
                defined.register_kernel("cuda")(op.body(op.cuda))
            defined.register_fake(op.body(op.fake))
            continue
        torch.library.define(name, op.schema)
        torch.library.impl(name, "default")(op.body(op.default))
        if op.cuda is not None:
            torch.library.impl(name, "cuda")(op.body(op.cuda))
        torch.library.register_fake(name)(op.body(op.fake))


_register(OPS)
