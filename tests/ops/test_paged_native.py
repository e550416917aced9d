"""The native paged shrink/expand (:mod:`lora_pin.ops.paged_native`) against the float64 paged reference
and the slot layout's whole-delta reference, on pools copied into scattered pages with NaN spare
pages: mixed ranks 4..64, page ranks 4/8/16, plain and fused q/k/v layers, decode and prefill."""

from __future__ import annotations

import pytest
import torch

from lora_pin._core import sgmv_cpu_available
from lora_pin._testing import random_layer, request_slots
from lora_pin.ops import KernelMeta, OpArgumentError, lora_reference, paged_native, segments_from_slots
from lora_pin.ops.paged import PageTable, pages_from_slots
from lora_pin.ops.paged_native import paged_expand_native, paged_shrink_native
from lora_pin.ops.paged_torch import paged_expand_torch, paged_shrink_torch
from lora_pin.ops.reference import paged_expand_reference, paged_shrink_reference

pytestmark = pytest.mark.skipif(not sgmv_cpu_available(), reason="the native kernels need AVX-512")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# Ranks 4..64 across slots, one slot idle (0) and one with a rank per slice.
RANKS = [4, 8, 16, 64, 0, (64, 0, 12), 24, 5, 32]
LAYERS = {"plain": [40], "qkv": [40, 16, 16]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.fixture(autouse=True)
def _native_only(monkeypatch):
    """The native path must run: a call that fell back to torch would test the torch path again."""

    def refuse(*args, **kwargs):
        raise AssertionError("the native path fell back to torch")

    monkeypatch.setattr(paged_native, "paged_shrink_torch", refuse)
    monkeypatch.setattr(paged_native, "paged_expand_torch", refuse)


def _case(dtype, page_rank, seed, layer_kind="qkv", phase="decode", chunk_size=3):
    gen = torch.Generator().manual_seed(seed)
    widths = LAYERS[layer_kind]
    ranks = [r if isinstance(r, int) or len(widths) == 3 else r[0] for r in RANKS]
    layer = random_layer(len(ranks), 48, widths, ranks, dtype, gen)
    slots = request_slots("uniform", 14, len(ranks), gen, base_fraction=0.2)
    # Decode: one token per request; prefill: 40 tokens per request (past a shrink group's 32 rows, and
    # past the native kernels' bf16 limit: GEMMs on views); interleaved: the requests' tokens in turn
    # (bf16: GEMMs on gathered rows).
    if phase == "interleaved":
        token_slots = slots.repeat(40)
    else:
        token_slots = torch.repeat_interleave(slots, 1 if phase == "decode" else 40)
    x = torch.randn(token_slots.shape[0], 48, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(dtype)
    a_pages, b_pages, pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, page_rank, spare_pages=2, generator=gen
    )
    meta = layer.meta(segments_from_slots(token_slots, chunk_size))
    return layer, token_slots, meta, x, out, a_pages, b_pages, pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_rank", [4, 8, 16])
@pytest.mark.parametrize("layer_kind", ["plain", "qkv"])
@pytest.mark.parametrize("phase", ["decode", "prefill", "interleaved"])
def test_paged_native_matches_the_references(phase, layer_kind, page_rank, dtype):
    layer, token_slots, meta, x, out, a_pages, b_pages, pages = _case(
        dtype, page_rank, page_rank, layer_kind, phase
    )
    max_rank = layer.a.shape[1] // meta.n_slices
    v = paged_shrink_native(x, a_pages, pages, meta, max_rank)
    want_v = paged_shrink_reference(x, a_pages, pages, meta, max_rank)
    _assert_close(v, want_v)
    assert torch.equal(v == 0, want_v == 0), "uncovered rows and columns past each rank must be exactly zero"
    got = out.clone()
    paged_expand_native(got, v, b_pages, pages, meta)
    _assert_close(got, paged_expand_reference(out, v, b_pages, pages, meta))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    untouched = (token_slots == -1) | (token_slots == RANKS.index(0))
    assert untouched.any()
    assert torch.equal(_bits(got[untouched]), _bits(out[untouched])), "rows without work must be untouched"


def test_busy_bf16_slots_run_as_gemms_on_views_and_gathered_rows():
    """The plan the reference tests above run through in bf16: every busy slot's ops as GEMMs."""
    for phase, gathered in (("prefill", False), ("interleaved", True)):
        layer, _, meta, x, _, a_pages, _, pages = _case(torch.bfloat16, 8, 0, phase=phase)
        plan = paged_native.build_paged_plan(
            meta, pages, x.shape[0], layer.a.shape[1] // 3, a_pages.shape[0], torch.bfloat16
        )
        assert plan.blas_shrink and all((busy.rows is not None) == gathered for busy in plan.blas_shrink)


@pytest.mark.parametrize("threads", [1, 2])
def test_paged_native_matches_the_torch_version_threaded(threads):
    layer, _, meta, x, out, a_pages, b_pages, pages = _case(torch.float32, 8, 5, phase="prefill")
    max_rank = layer.a.shape[1] // meta.n_slices
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        v = paged_shrink_native(x, a_pages, pages, meta, max_rank)
        got = out.clone()
        paged_expand_native(got, v, b_pages, pages, meta)
    finally:
        torch.set_num_threads(before)
    _assert_close(v, paged_shrink_torch(x, a_pages, pages, meta, max_rank))
    want = out.clone()
    paged_expand_torch(want, v, b_pages, pages, meta)
    _assert_close(got, want)


def test_empty_segments_and_base_rows_change_nothing():
    layer, _, _, x, out, a_pages, b_pages, pages = _case(torch.bfloat16, 8, 3)
    n = x.shape[0]
    # An empty segment of a busy slot, a segment of slot -1 and one of the idle slot: no work at all.
    segments = KernelMeta(
        torch.arange(n, dtype=torch.int64),
        torch.tensor([0, 0, n // 2, n], dtype=torch.int32),
        torch.tensor([3, -1, RANKS.index(0)], dtype=torch.int32),
    )
    meta = layer.meta(segments)
    max_rank = layer.a.shape[1] // meta.n_slices
    v = paged_shrink_native(x, a_pages, pages, meta, max_rank)
    assert torch.equal(v, torch.zeros_like(v))
    got = out.clone()
    paged_expand_native(got, torch.randn_like(v), b_pages, pages, meta)
    assert torch.equal(_bits(got), _bits(out))


def test_a_perturbed_page_lookup_is_seen():
    layer, token_slots, meta, x, out, a_pages, b_pages, pages = _case(torch.float32, 8, 1)
    max_rank = layer.a.shape[1] // meta.n_slices
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    shifted = PageTable(pages.page_indptr, pages.page_table.roll(-1), pages.page_rank)
    for shrink_pages, expand_pages in ((shifted, pages), (pages, shifted)):
        got = out.clone()
        v = paged_shrink_native(x, a_pages, shrink_pages, meta, max_rank)
        paged_expand_native(got, v, b_pages, expand_pages, meta)
        assert not torch.allclose(got, want, atol=1e-4)


def test_non_contiguous_pools_fall_back_to_torch(monkeypatch):
    monkeypatch.setattr(paged_native, "paged_shrink_torch", paged_shrink_torch)
    monkeypatch.setattr(paged_native, "paged_expand_torch", paged_expand_torch)
    layer, token_slots, meta, x, out, a_pages, b_pages, pages = _case(torch.float32, 16, 4)
    max_rank = layer.a.shape[1] // meta.n_slices
    a_strided = a_pages.transpose(1, 2).contiguous().transpose(1, 2)
    b_strided = b_pages.transpose(1, 2).contiguous().transpose(1, 2)
    v = paged_shrink_native(x, a_strided, pages, meta, max_rank)
    got = out.clone()
    paged_expand_native(got, v, b_strided, pages, meta)
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


def test_bad_inputs_are_refused_by_name_and_change_nothing():
    layer, _, meta, x, out, a_pages, b_pages, pages = _case(torch.float32, 16, 2)
    max_rank = layer.a.shape[1] // meta.n_slices
    v = paged_shrink_native(x, a_pages, pages, meta, max_rank)
    got = out.clone()
    short = pages.page_indptr.clone()
    short[RANKS.index(64) + 1 :] -= 1
    with pytest.raises(OpArgumentError, match="has ranks"):
        paged_expand_native(got, v, b_pages, PageTable(short, pages.page_table[:-1], 16), meta)
    outside = pages.page_table.clone()
    outside[-1] = a_pages.shape[0]
    with pytest.raises(OpArgumentError, match="page_table holds pages outside"):
        paged_expand_native(got, v, b_pages, pages._replace(page_table=outside), meta)
    indptr = pages.page_indptr.tolist()
    falling = torch.tensor([indptr[0], indptr[2], indptr[1], *indptr[3:]], dtype=torch.int32)
    with pytest.raises(OpArgumentError, match="page_indptr must rise"):
        paged_shrink_native(x, a_pages, pages._replace(page_indptr=falling), meta, max_rank)
    with pytest.raises(OpArgumentError, match="page_indptr must be int32"):
        paged_shrink_native(x, a_pages, pages._replace(page_indptr=pages.page_indptr.long()), meta, max_rank)
    with pytest.raises(OpArgumentError, match="b_pages must be"):
        paged_expand_native(got, v, b_pages[:, :, :8], pages, meta)
    shared = v.clone()
    with pytest.raises(OpArgumentError, match="out overlaps v"):
        paged_expand_native(shared.view(-1)[: out.numel()].view(out.shape), shared, b_pages, pages, meta)
    assert torch.equal(shared, v)
    assert torch.equal(_bits(got), _bits(out)), "a refused call must leave out as it was"
    with pytest.raises(OpArgumentError, match="a_pages must be"):
        paged_shrink_native(x, a_pages[:, :16], pages, meta, max_rank)
    with pytest.raises(OpArgumentError, match=r"a_pages is torch\.float16"):
        paged_shrink_native(x, a_pages.half(), pages, meta, max_rank)


def test_the_native_page_table_refuses_bad_tables_by_name():
    from lora_pin._core import CpuPageTable

    assert CpuPageTable([0, 2, 2], [3, 0], page_rank=8, num_pages=4).n_slots == 2
    with pytest.raises(OpArgumentError, match=r"page_table\[0\] = 4 lies outside"):
        CpuPageTable([0, 1], [4], page_rank=8, num_pages=4)
    with pytest.raises(OpArgumentError, match="page_indptr must rise"):
        CpuPageTable([0, 2, 1], [0, 1], page_rank=8, num_pages=4)
    with pytest.raises(OpArgumentError, match="page_rank must be at least 1"):
        CpuPageTable([0, 1], [0], page_rank=0, num_pages=4)
