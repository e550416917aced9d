"""The torch paged shrink/expand (the CPU fallback) against the float64 paged reference and the slot
layout's whole-delta reference, on pools copied into scattered pages with NaN spare pages."""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import random_layer, request_slots
from lora_pin.ops import OpArgumentError, lora_reference, segments_from_slots
from lora_pin.ops.paged import PageTable, pages_from_slots
from lora_pin.ops.paged_torch import paged_expand_torch, paged_shrink_torch
from lora_pin.ops.reference import paged_expand_reference, paged_shrink_reference

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
RANKS = [4, 8, 16, 64, 0, (64, 0, 12), 24, 5]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def _case(dtype, page_rank, seed, chunk_size=3):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(len(RANKS), 48, [40, 16, 16], RANKS, dtype, gen)
    token_slots = torch.repeat_interleave(request_slots("uniform", 14, len(RANKS), gen, base_fraction=0.2), 3)
    x = torch.randn(token_slots.shape[0], 48, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(dtype)
    a_pages, b_pages, pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, page_rank, spare_pages=2, generator=gen
    )
    meta = layer.meta(segments_from_slots(token_slots, chunk_size))
    return layer, token_slots, meta, x, out, a_pages, b_pages, pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_rank", [8, 12, 64])
def test_paged_torch_matches_the_references(page_rank, dtype):
    layer, token_slots, meta, x, out, a_pages, b_pages, pages = _case(dtype, page_rank, page_rank)
    max_rank = layer.a.shape[1] // 3
    v = paged_shrink_torch(x, a_pages, pages, meta, max_rank)
    want_v = paged_shrink_reference(x, a_pages, pages, meta, max_rank)
    _assert_close(v, want_v)
    assert torch.equal(v == 0, want_v == 0), "uncovered rows and columns past each rank must be exactly zero"
    got = out.clone()
    paged_expand_torch(got, v, b_pages, pages, meta)
    _assert_close(got, paged_expand_reference(out, v, b_pages, pages, meta))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    untouched = (token_slots == -1) | (token_slots == RANKS.index(0))
    assert torch.equal(_bits(got[untouched]), _bits(out[untouched])), "rows without work must be untouched"


def test_a_perturbed_page_lookup_is_seen():
    layer, token_slots, meta, x, out, a_pages, b_pages, pages = _case(torch.float32, 8, 1)
    shifted = PageTable(pages.page_indptr, pages.page_table.roll(-1), pages.page_rank)
    v = paged_shrink_torch(x, a_pages, shifted, meta, layer.a.shape[1] // 3)
    got = out.clone()
    paged_expand_torch(got, v, b_pages, pages, meta)
    assert not torch.allclose(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]), atol=1e-4)


def test_bad_page_tables_are_refused_and_change_nothing():
    layer, _, meta, x, out, a_pages, b_pages, pages = _case(torch.float32, 16, 2)
    max_rank = layer.a.shape[1] // 3
    v = paged_shrink_torch(x, a_pages, pages, meta, max_rank)
    got = out.clone()
    short = pages.page_indptr.clone()
    short[RANKS.index(64) + 1 :] -= 1
    with pytest.raises(OpArgumentError, match="has ranks"):
        paged_expand_torch(got, v, b_pages, PageTable(short, pages.page_table[:-1], 16), meta)
    outside = pages.page_table.clone()
    outside[-1] = -1
    with pytest.raises(OpArgumentError, match="page_table holds pages outside"):
        paged_expand_torch(got, v, b_pages, pages._replace(page_table=outside), meta)
    with pytest.raises(OpArgumentError, match="b_pages must be"):
        paged_expand_torch(got, v, b_pages[:, :, :8], pages, meta)
    assert torch.equal(_bits(got), _bits(out)), "a refused call must leave out as it was"
    with pytest.raises(OpArgumentError, match="a_pages must be"):
        paged_shrink_torch(x, a_pages[:, :16], pages, meta, max_rank)
