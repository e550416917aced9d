"""The paged custom ops ``lora_pin::paged_shrink`` / ``lora_pin::paged_expand`` on CPU: registration,
the faces against the native functions and the fp64 reference, opcheck, torch.compile (fullgraph)."""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import random_layer
from lora_pin.ops import (
    KernelMeta,
    OpArgumentError,
    PageTable,
    lora_reference,
    paged_expand,
    paged_shrink,
    segments_from_slots,
)
from lora_pin.ops.paged import pages_from_slots
from lora_pin.ops.paged_native import paged_expand_native, paged_shrink_native


def _small_case(dtype=torch.float32, page_rank=4):
    gen = torch.Generator().manual_seed(8)
    layer = random_layer(3, 16, [12, 4, 4], [8, (2, 0, 4), 5], dtype, gen)
    token_slots = torch.tensor([2, -1, 0, 1, 0, 2, 2, -1])
    x = torch.randn(8, 16, generator=gen).to(dtype)
    out = torch.randn(8, 20, generator=gen).to(dtype)
    a_pages, b_pages, pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, page_rank, spare_pages=1, generator=gen
    )
    return layer, token_slots, segments_from_slots(token_slots, 2), x, out, a_pages, b_pages, pages


def _op_args(pages):
    return pages.page_indptr, pages.page_table, pages.page_rank


def test_ops_are_registered_and_match_the_native_functions():
    layer, token_slots, batch, x, out, a_pages, b_pages, pages = _small_case()
    meta, max_rank = layer.meta(batch), layer.a.shape[1] // 3
    v = torch.ops.lora_pin.paged_shrink(
        x, a_pages, *_op_args(pages), *batch[:3], layer.slot_ranks, 3, max_rank
    )
    assert torch.equal(v, paged_shrink(x, a_pages, pages, meta, max_rank))
    assert torch.equal(v, paged_shrink_native(x, a_pages, pages, meta, max_rank))
    via_op, via_face, via_native = out.clone(), out.clone(), out.clone()
    torch.ops.lora_pin.paged_expand(via_op, v, b_pages, *_op_args(pages), *batch[:3], *layer[2:])
    paged_expand(via_face, v, b_pages, pages, meta)
    paged_expand_native(via_native, v, b_pages, pages, meta)
    assert torch.equal(via_op, via_face) and torch.equal(via_op, via_native)
    torch.testing.assert_close(via_op, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    layer, _, batch, x, out, a_pages, b_pages, pages = _small_case(dtype)
    max_rank = layer.a.shape[1] // 3
    torch.library.opcheck(
        torch.ops.lora_pin.paged_shrink.default,
        (x, a_pages, *_op_args(pages), *batch[:3], layer.slot_ranks, 3, max_rank),
    )
    v = paged_shrink(x, a_pages, pages, layer.meta(batch), max_rank)
    torch.library.opcheck(
        torch.ops.lora_pin.paged_expand.default,
        (out, v, b_pages, *_op_args(pages), *batch[:3], *layer[2:]),
    )


def test_the_faces_refuse_bad_pages_and_grad_by_name():
    layer, _, batch, x, out, a_pages, b_pages, pages = _small_case()
    meta, max_rank = layer.meta(batch), layer.a.shape[1] // 3
    with pytest.raises(OpArgumentError, match=r"a_pages must be \[num_pages, n_slices \* page_rank = 24"):
        paged_shrink(x, a_pages, pages._replace(page_rank=8), meta, max_rank)
    v = paged_shrink(x, a_pages, pages, meta, max_rank)
    got = out.clone()
    with pytest.raises(OpArgumentError, match="page_table must be int32"):
        paged_expand(got, v, b_pages, pages._replace(page_table=pages.page_table.long()), meta)
    with pytest.raises(OpArgumentError, match="no autograd formula"):
        paged_expand(got, v.requires_grad_(), b_pages, pages, meta)
    assert torch.equal(got, out)


class _PagedLoRALinear(torch.nn.Module):
    """A fused q/k/v projection over a paged pool, as a model integration would call the ops."""

    def __init__(self, layer, a_pages, b_pages, pages):
        super().__init__()
        self.base = torch.nn.Linear(layer.a.shape[2], layer.slice_offsets[-1], dtype=layer.a.dtype)
        for name, t in (
            ("a_pages", a_pages),
            ("b_pages", b_pages),
            ("page_indptr", pages.page_indptr),
            ("page_table", pages.page_table),
            ("slot_ranks", layer.slot_ranks),
            ("slot_scalings", layer.slot_scalings),
        ):
            self.register_buffer(name, t)
        self.page_rank, self.max_rank = pages.page_rank, layer.a.shape[1] // 3
        self.slice_offsets = layer.slice_offsets

    def forward(self, x, perm, seg_indptr, seg_slots):
        y = self.base(x)
        segments = KernelMeta(perm, seg_indptr, seg_slots)
        meta = KernelMeta.for_layer(segments, self.slot_ranks, self.slot_scalings, self.slice_offsets)
        pages = PageTable(self.page_indptr, self.page_table, self.page_rank)
        paged_expand(y, paged_shrink(x, self.a_pages, pages, meta, self.max_rank), self.b_pages, pages, meta)
        return torch.nn.functional.silu(y)


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_fullgraph():
    layer, _, batch, x, _, a_pages, b_pages, pages = _small_case()
    module = _PagedLoRALinear(layer, a_pages, b_pages, pages)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    other = segments_from_slots(torch.tensor([0, 0, 1, -1, 2, 1, 0, 2]), 3)
    with torch.no_grad():
        for segments in (batch, other):
            want = module(x, *segments[:3])
            torch.testing.assert_close(compiled(x, *segments[:3]), want)
            assert not torch.equal(want, torch.nn.functional.silu(module.base(x))), "the delta must count"
