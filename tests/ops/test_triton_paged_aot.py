"""The paged Triton kernels built for an H100/H200 (sm_90) on this machine, with no GPU, and the same
GPU-sized launches run under the interpreter against the reference (see test_triton_aot.py: these
catch a kernel that the interpreter runs but Triton's compiler refuses, spills or overfills)."""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import random_layer, request_slots
from lora_pin.ops import lora_reference, segments_from_slots
from lora_pin.ops.paged import pages_from_slots

triton_sgmv = pytest.importorskip("lora_pin.ops.triton_sgmv")
triton_paged = pytest.importorskip("lora_pin.ops.triton_paged")
triton_aot = pytest.importorskip("lora_pin.ops.triton_aot")

pytestmark = pytest.mark.triton

H200_SMS = 132
# Wide enough for decode's shrink to split K (four BLOCK_K tiles a split).
HIDDEN = 1024

# (dtype, widths, max rank, page rank, requests, tokens each, chunk): decode (BLOCK_M 16), 30- and
# 100-token segments (BLOCK_M 32, 64), BLOCK_R 16/32/64 over pages of 8 and 16, fused q/k/v.
SHAPES = [
    (dtype, [HIDDEN], rank, page_rank, *regime)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for rank, page_rank in ((8, 8), (32, 8), (64, 16))
    for regime in ((16, 1, 16), (4, 30, None), (2, 100, None))
] + [(torch.float16, [HIDDEN, 64, 64], 64, 8, 8, 2, 16)]


def _inputs(dtype, widths, rank, page_rank, n_requests, tokens, chunk_size):
    gen = torch.Generator().manual_seed(0)
    n_slices = len(widths)
    ranks = [rank, max(1, rank // 4), 0, 4] + ([(rank,) + (0,) * (n_slices - 1)] if n_slices > 1 else [])
    layer = random_layer(8, HIDDEN, widths, ranks, dtype, gen, max_rank=rank)
    slots = request_slots("uniform", n_requests, 8, gen, base_fraction=max(0.25, 1 / n_requests))
    token_slots = torch.repeat_interleave(slots, tokens)
    meta = layer.meta(segments_from_slots(token_slots, chunk_size))
    a_pages, b_pages, pages = pages_from_slots(layer.a, layer.b, layer.slot_ranks, page_rank, generator=gen)
    x = torch.randn(token_slots.shape[0], HIDDEN, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], sum(widths), generator=gen).to(dtype)
    segments = meta.seg_slots.shape[0]
    split = triton_sgmv.shrink_split_k(HIDDEN, segments, n_slices, rank, dtype, 2 * H200_SMS)
    v = x.new_zeros(x.shape[0], n_slices * rank, dtype=torch.float32 if split > 1 else dtype)
    shrink = triton_paged.paged_shrink_launch(x, a_pages, v, pages, meta, rank, split, interpret=False)
    got = out.clone()
    # Expand reads v in the activations' dtype (paged_shrink rounds split-K's fp32 sums once).
    v_rounded = x.new_zeros(x.shape[0], n_slices * rank)
    expand = triton_paged.paged_expand_launch(got, v_rounded, b_pages, pages, meta, interpret=False)
    return layer, token_slots, x, out, got, shrink, expand


def _id(shape) -> str:
    return f"{str(shape[0])[6:]}-x{len(shape[1])}-r{shape[2]}p{shape[3]}-{shape[4]}x{shape[5]}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_every_paged_launch_builds_for_sm90_without_spills(shape):
    for launch in _inputs(*shape)[-2:]:
        build = triton_aot.compile_launch(launch, arch=90)
        assert build.name == launch.kernel.__name__
        assert build.local_bytes == 0, f"{build.name} {build.constexprs} spills {build.local_bytes} B"
        assert build.fits, build


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] != torch.bfloat16], ids=_id)
def test_the_sm90_paged_launches_equal_the_reference_under_the_interpreter(shape):
    layer, token_slots, x, out, got, shrink, expand = _inputs(*shape)
    shrink.run(interpret=True)
    expand.args[1].copy_(shrink.args[2])
    expand.run(interpret=True)
    want = lora_reference(out, x, layer.a, layer.b, token_slots, *layer[2:])
    tol = {torch.float32: 1e-4, torch.float16: 5e-3}[x.dtype] * want.abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=0)
    base = token_slots < 0
    assert base.any() and torch.equal(got[base], out[base]), "a base-model row was touched"


def test_decode_splits_k_and_long_segments_take_wide_row_tiles():
    # The shapes above claim to cover split-K and every row tile; check the launchers chose them.
    decode = _inputs(torch.float16, [HIDDEN], 32, 8, 16, 1, 16)[-2]
    assert decode.constexprs["SPLIT_K"] > 1 and decode.args[2].dtype == torch.float32
    prefill_shrink, prefill_expand = _inputs(torch.float16, [HIDDEN], 32, 8, 2, 100, None)[-2:]
    assert prefill_shrink.constexprs["BLOCK_M"] == 64 and prefill_expand.constexprs["BLOCK_M"] == 64
