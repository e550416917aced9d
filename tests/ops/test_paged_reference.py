"""The fp64 references of the paged shrink/expand against the slot-layout references on the same
weights: a slot pool copied into scattered rank pages (:func:`pages_from_slots`) must give the same
results to float64 rounding, for mixed ranks, absent slices and page sizes that do and do not divide
the ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

from lora_pin._testing import random_layer, request_slots
from lora_pin.ops import OpArgumentError, expand_reference, segments_from_slots, shrink_reference
from lora_pin.ops.paged import PageTable, pages_from_slots
from lora_pin.ops.reference import paged_expand_reference, paged_shrink_reference

RANKS = [4, 8, 16, 64, 0, (64, 0, 12), 24, 5]


def _case(page_rank: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(len(RANKS), 32, [24, 8, 8], RANKS, torch.float64, gen)
    token_slots = torch.repeat_interleave(request_slots("uniform", 16, len(RANKS), gen, base_fraction=0.2), 2)
    x = torch.randn(token_slots.shape[0], 32, generator=gen, dtype=torch.float64)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen, dtype=torch.float64)
    meta = layer.meta(segments_from_slots(token_slots, 3))
    a_pages, b_pages, pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, page_rank, spare_pages=3, generator=gen
    )
    return layer, meta, x, out, a_pages, b_pages, pages


@pytest.mark.parametrize("page_rank", [1, 8, 12, 16, 64])
def test_paged_references_equal_the_slot_references(page_rank):
    layer, meta, x, out, a_pages, b_pages, pages = _case(page_rank)
    max_rank = layer.a.shape[1] // 3
    v = paged_shrink_reference(x, a_pages, pages, meta, max_rank)
    want_v = shrink_reference(x, layer.a, meta)
    torch.testing.assert_close(v, want_v, rtol=1e-12, atol=1e-12)
    assert torch.equal(v == 0, want_v == 0), "uncovered rows and columns past the rank must stay zero"
    got = paged_expand_reference(out, v, b_pages, pages, meta)
    torch.testing.assert_close(got, expand_reference(out, v, layer.b, meta), rtol=1e-12, atol=1e-12)


def test_pages_are_scattered_and_zero_past_the_rank():
    # The test above would pass on an identity layout; check the pool is really paged.
    _, _, _, _, a_pages, _, pages = _case(8, seed=1)
    indptr, table = pages.page_indptr.tolist(), pages.page_table.tolist()
    assert len(set(table)) == len(table), "no page shared"
    assert any(b < a for a, b in itertools.pairwise(table)), "pages should not be ascending"
    slot = RANKS.index(5)  # one page of 8 ranks, 3 past the rank
    (page,) = table[indptr[slot] : indptr[slot + 1]]
    assert torch.equal(a_pages[page, 5:8], torch.zeros_like(a_pages[page, 5:8]))
    assert indptr[RANKS.index(0) + 1] == indptr[RANKS.index(0)], "rank 0 takes no page"


def test_a_perturbed_page_lookup_is_seen():
    # Page j read as page j + 1 of the same slot (or the next slot's): results must change.
    layer, meta, x, _, a_pages, _, pages = _case(8)
    max_rank = layer.a.shape[1] // 3
    rolled = PageTable(pages.page_indptr, pages.page_table.roll(1), pages.page_rank)
    v = paged_shrink_reference(x, a_pages, rolled, meta, max_rank)
    assert not torch.allclose(v, shrink_reference(x, layer.a, meta))


def test_bad_page_tables_are_refused():
    layer, meta, x, _, a_pages, _, pages = _case(16)
    max_rank = layer.a.shape[1] // 3
    short = pages.page_indptr.clone()
    slot = RANKS.index(64)
    short[slot + 1 :] -= 1  # slot of rank 64 left with 3 pages of 16
    with pytest.raises(OpArgumentError, match=f"slot {slot} has ranks"):
        paged_shrink_reference(x, a_pages, PageTable(short, pages.page_table[:-1], 16), meta, max_rank)
    outside = pages.page_table.clone()
    outside[0] = a_pages.shape[0]
    with pytest.raises(OpArgumentError, match="page_table holds pages outside"):
        paged_shrink_reference(x, a_pages, PageTable(pages.page_indptr, outside, 16), meta, max_rank)
