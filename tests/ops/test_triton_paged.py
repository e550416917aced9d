"""The Triton shrink/expand on page tables against the float64 paged reference.

On CPU they run under the Triton interpreter (the launchers wrap the kernels for it, as in
test_triton_sgmv.py, so ``TRITON_INTERPRET`` is never needed): fp32 and fp16, tiny shapes. The pools
come from a slot pool copied into scattered pages (:func:`pages_from_slots`), with spare pages of NaN:
a kernel that reads a wrong page, or past a slot's rank into another page, shows it.
"""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import random_layer, request_slots
from lora_pin.ops import OpArgumentError, lora_reference, segments_from_slots
from lora_pin.ops.paged import PageTable, pages_from_slots
from lora_pin.ops.reference import paged_expand_reference, paged_shrink_reference

triton_paged = pytest.importorskip("lora_pin.ops.triton_paged")

pytestmark = pytest.mark.triton

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.float16]
# Ranks 4..64 across slots; slot 5 lacks its k and v slices, slot 4 is a no-op.
RANKS = [4, 8, 16, 64, 0, (64, 0, 12), 24, 5]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _case(dtype, page_rank, seed, *, pattern="uniform", n_requests=14, tokens=2):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(len(RANKS), 48, [40, 16, 16], RANKS, dtype, gen)
    token_slots = torch.repeat_interleave(
        request_slots(pattern, n_requests, len(RANKS), gen, base_fraction=0.2), tokens
    )
    x = torch.randn(token_slots.shape[0], 48, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(dtype)
    a_pages, b_pages, pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, page_rank, spare_pages=2, generator=gen
    )
    return layer, token_slots, x, out, a_pages, b_pages, pages


def _run(a_pages, b_pages, pages, meta, x, out, max_rank):
    v = triton_paged.paged_shrink(x, a_pages, pages, meta, max_rank)
    got = out.clone()
    triton_paged.paged_expand(got, v, b_pages, pages, meta)
    return v, got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_rank", [8, 16, 12])
def test_paged_shrink_and_expand_match_the_reference(page_rank, dtype):
    layer, token_slots, x, out, a_pages, b_pages, pages = _case(dtype, page_rank, page_rank)
    meta = layer.meta(segments_from_slots(token_slots, 3))
    max_rank = layer.a.shape[1] // 3
    v, got = _run(a_pages, b_pages, pages, meta, x, out, max_rank)
    want_v = paged_shrink_reference(x, a_pages, pages, meta, max_rank)
    _assert_close(v, want_v)
    assert torch.equal(v == 0, want_v == 0), "uncovered rows and columns past each rank must be exactly zero"
    _assert_close(got, paged_expand_reference(out, v, b_pages, pages, meta))
    # And the whole delta, from the slot pool the pages were copied from.
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    untouched = (token_slots == -1) | (token_slots == RANKS.index(0))
    assert torch.equal(_bits(got[untouched]), _bits(out[untouched])), "rows without work must be untouched"


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_and_long_segments(split_k, dtype):
    # Unchunked segments longer than BLOCK_M loop over row blocks; split-K accumulates with atomics.
    layer, token_slots, x, out, a_pages, b_pages, pages = _case(dtype, 8, 3, pattern="zipf", tokens=7)
    meta = layer.meta(segments_from_slots(token_slots, None))
    max_rank = layer.a.shape[1] // 3
    v = triton_paged.paged_shrink(x, a_pages, pages, meta, max_rank, split_k=split_k)
    _assert_close(v, paged_shrink_reference(x, a_pages, pages, meta, max_rank))
    got = out.clone()
    triton_paged.paged_expand(got, v, b_pages, pages, meta)
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


def test_weights_past_the_rank_are_never_loaded():
    # The unused rows of each slot's last page set to NaN: the rank bounds every load.
    layer, token_slots, x, out, a_pages, b_pages, pages = _case(torch.float32, 16, 5)
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    indptr, table = pages.page_indptr.tolist(), pages.page_table.tolist()
    for slot, row in enumerate(layer.slot_ranks.tolist()):
        if indptr[slot + 1] == indptr[slot]:
            continue
        last, first_rank = table[indptr[slot + 1] - 1], 16 * (indptr[slot + 1] - indptr[slot] - 1)
        for s, rank in enumerate(row):
            a_pages[last, s * 16 + max(rank - first_rank, 0) : (s + 1) * 16] = float("nan")
        lo, hi = layer.slice_offsets[:2]
        b_pages[last, lo:hi, max(row[0] - first_rank, 0) :] = float("nan")
    meta = layer.meta(segments_from_slots(token_slots, 2))
    max_rank = layer.a.shape[1] // 3
    v, got = _run(a_pages, b_pages, pages, meta, x, out, max_rank)
    _assert_close(v, paged_shrink_reference(x, a_pages, pages, meta, max_rank))
    _assert_close(got, want)


@pytest.mark.parametrize("pool", ["a", "b"])
def test_a_perturbed_page_lookup_is_seen(pool):
    # Page j read as page j + 1 (within the table; the last entry wraps to the first).
    layer, token_slots, x, out, a_pages, b_pages, pages = _case(torch.float32, 8, 7)
    meta = layer.meta(segments_from_slots(token_slots, 3))
    max_rank = layer.a.shape[1] // 3
    shifted = PageTable(pages.page_indptr, pages.page_table.roll(-1), pages.page_rank)
    v = triton_paged.paged_shrink(x, a_pages, shifted if pool == "a" else pages, meta, max_rank)
    got = out.clone()
    triton_paged.paged_expand(got, v, b_pages, shifted if pool == "b" else pages, meta)
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    assert not torch.allclose(got, want, atol=1e-4, rtol=1e-4, equal_nan=False)


def test_bad_arguments_are_refused_and_change_nothing():
    layer, token_slots, x, out, a_pages, b_pages, pages = _case(torch.float32, 16, 9)
    meta = layer.meta(segments_from_slots(token_slots, 3))
    max_rank = layer.a.shape[1] // 3
    with pytest.raises(OpArgumentError, match="a_pages must be"):
        triton_paged.paged_shrink(x, a_pages[:, :16], pages, meta, max_rank)
    with pytest.raises(OpArgumentError, match="page_indptr must be int32"):
        triton_paged.paged_shrink(
            x, a_pages, pages._replace(page_indptr=pages.page_indptr[:-1]), meta, max_rank
        )
    outside = pages.page_table.clone()
    outside[0] = a_pages.shape[0]
    with pytest.raises(OpArgumentError, match="page_table holds pages outside"):
        triton_paged.paged_shrink(x, a_pages, pages._replace(page_table=outside), meta, max_rank)
    with pytest.raises(OpArgumentError, match="slot_ranks must lie in"):
        triton_paged.paged_shrink(x, a_pages, pages, meta, 32)
    v = triton_paged.paged_shrink(x, a_pages, pages, meta, max_rank)
    got = out.clone()
    with pytest.raises(OpArgumentError, match="b_pages must be"):
        triton_paged.paged_expand(got, v, b_pages[:, :, :8], pages, meta)
    short = pages.page_indptr.clone()
    short[RANKS.index(64) + 1 :] -= 1
    with pytest.raises(OpArgumentError, match="has ranks"):
        triton_paged.paged_expand(got, v, b_pages, PageTable(short, pages.page_table[:-1], 16), meta)
    assert torch.equal(_bits(got), _bits(out)), "a refused call must leave out as it was"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_device(dtype, seed, device="cuda"):
    # Built on CPU in fp32 (pages_from_slots, the tables), then moved: the pool and tables a GPU holds.
    layer, token_slots, x, out, a_pages, b_pages, pages = _case(torch.float32, 8, seed, pattern="zipf")
    layer = layer._replace(
        a=layer.a.to(device, dtype),
        b=layer.b.to(device, dtype),
        slot_ranks=layer.slot_ranks.to(device),
        slot_scalings=layer.slot_scalings.to(device),
    )
    pages = PageTable(pages.page_indptr.to(device), pages.page_table.to(device), pages.page_rank)
    moved = (t.to(device, dtype) for t in (x, out, a_pages, b_pages))
    return layer, token_slots.to(device), *moved, pages


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_paged_kernels_match_the_reference(dtype):
    layer, token_slots, x, out, a_pages, b_pages, pages = _on_device(dtype, 21)
    meta = layer.meta(segments_from_slots(token_slots, 16))
    _, got = _run(a_pages, b_pages, pages, meta, x, out, layer.a.shape[1] // 3)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)
    base = token_slots < 0
    assert torch.equal(_bits(got[base]), _bits(out[base]))


@cuda
def test_cuda_paged_kernels_never_synchronise_and_replay_in_a_cuda_graph():
    layer, token_slots, x, out, a_pages, b_pages, pages = _on_device(torch.float16, 22)
    meta = layer.meta(segments_from_slots(token_slots, 16))
    max_rank = layer.a.shape[1] // 3
    work = out.clone()
    _run(a_pages, b_pages, pages, meta, x, work, max_rank)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            v = triton_paged.paged_shrink(x, a_pages, pages, meta, max_rank)
            triton_paged.paged_expand(work, v, b_pages, pages, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    work.copy_(out)
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(work, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
