"""The CPU backend's per-step shrink and expand run apart (``CpuShrink`` / ``CpuExpand``), as a fully
sharded tensor-parallel layer runs them: against the fp64 reference, a strided output (a row layer's
column slice), a shrink over other ranks than the expand's (a column layer's chunk), and refusals. Every
test runs with the native kernels and with the torch path alone."""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import PATTERNS, random_layer, request_slots
from lora_pin.ops import OpArgumentError, expand_reference, segments_from_slots, shrink_reference
from lora_pin.ops.backends.cpu import CpuExpand, CpuShrink

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


pytestmark = pytest.mark.usefixtures("cpu_path")  # native kernels, then the torch path (conftest.py)


def _case(pattern, tokens_per_request, dtype, seed=0, hidden=48, widths=(64, 16, 16), ranks=(8, (4, 0, 8))):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(10, hidden, list(widths), list(ranks), dtype, gen)
    slots = request_slots(pattern, 12, 10, gen, base_fraction=0.25)
    token_slots = torch.repeat_interleave(slots, tokens_per_request)
    x = torch.randn(token_slots.shape[0], hidden, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(dtype)
    return layer, token_slots, x, out


def _assert_close(got, want):
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 19], ids=["decode", "prefill"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_prepared_shrink_then_expand_match_the_fp64_reference(pattern, tokens, dtype):
    layer, token_slots, x, out = _case(pattern, tokens, dtype)
    meta = layer.meta(segments_from_slots(token_slots, 4))
    shrink_d = CpuShrink.prepare(meta, layer.a, x.shape[0])
    expand_d = CpuExpand.prepare(meta, layer.b, x.shape[0])
    got = out.clone()
    with torch.inference_mode():
        v = shrink_d.apply(x)
        expand_d.apply(got, v)
    _assert_close(v, shrink_reference(x, layer.a, meta))
    _assert_close(got, expand_reference(out, v, layer.b, meta))
    base = token_slots < 0
    assert torch.equal(got[base], out[base])  # rows with no adapter are untouched, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 19], ids=["decode", "prefill"])
def test_an_expand_into_a_column_slice_leaves_the_other_columns(tokens, dtype):
    # A row layer's expand writes its own columns of the partial product, a strided view.
    layer, token_slots, x, _ = _case("uniform", tokens, dtype, widths=(32,), ranks=(8, 3))
    meta = layer.meta(segments_from_slots(token_slots, 4))
    expand_d = CpuExpand.prepare(meta, layer.b, x.shape[0])
    v = shrink_reference(x, layer.a, meta).to(dtype)
    partial = torch.randn(x.shape[0], 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = partial.clone()
    with torch.inference_mode():
        expand_d.apply(got[:, 32:64], v)
    assert torch.equal(got[:, :32], partial[:, :32]) and torch.equal(got[:, 64:], partial[:, 64:])
    want = expand_reference(partial[:, 32:64].contiguous(), v, layer.b, meta)
    _assert_close(got[:, 32:64], want)
    base = token_slots < 0
    assert torch.equal(got[base], partial[base])


def test_a_shrink_over_a_chunk_of_the_rank_uses_its_own_ranks():
    # A column layer's chunk of the rank dimension: rows [4, 8) of each slice of a rank-8 pool, where a
    # rank-4 slot has none (its shrink is zeros, so the prepared shrink is empty when only it is used).
    layer, _, x, _ = _case("uniform", 1, torch.float32)
    chunk = layer.a.view(10, 3, 8, -1)[:, :, 4:].reshape(10, 12, -1).contiguous()
    local = (layer.slot_ranks - 4).clamp(0, 4).to(torch.int32)
    token_slots = torch.tensor([0, -1, 1, 0] * 3)  # slot 0 has ranks 8, slot 1 ranks (4, 0, 8)
    meta = layer.meta(segments_from_slots(token_slots))._replace(slot_ranks=local)
    shrink_d = CpuShrink.prepare(meta, chunk, x.shape[0])
    with torch.inference_mode():
        v = shrink_d.apply(x)
    _assert_close(v, shrink_reference(x, chunk, meta))
    assert not shrink_d.empty
    only_rank_4 = torch.tensor([1, -1, 1, -1] * 3)
    only_rank_4_ranks = local.clone()
    only_rank_4_ranks[1] = torch.tensor([0, 0, 0], dtype=torch.int32)
    meta = layer.meta(segments_from_slots(only_rank_4))._replace(slot_ranks=only_rank_4_ranks)
    empty = CpuShrink.prepare(meta, chunk, x.shape[0])
    assert empty.empty
    with torch.inference_mode():
        assert torch.equal(empty.apply(x), torch.zeros(x.shape[0], 12))


def test_prepare_and_apply_refuse_what_does_not_fit():
    layer, token_slots, x, out = _case("zipf", 1, torch.float32)
    meta = layer.meta(segments_from_slots(token_slots))
    shrink_d = CpuShrink.prepare(meta, layer.a, x.shape[0])
    expand_d = CpuExpand.prepare(meta, layer.b, x.shape[0])
    with pytest.raises(OpArgumentError, match=r"shrink was prepared for x torch\.float32"):
        shrink_d.apply(x[:-1])
    v = torch.zeros(x.shape[0], 24)
    with pytest.raises(OpArgumentError, match=r"expand was prepared for out torch\.float32"):
        expand_d.apply(out.clone(), v[:, :8])
    with pytest.raises(OpArgumentError, match="no autograd formula"):
        shrink_d.apply(x.clone().requires_grad_())
    bad = meta._replace(perm=meta.perm.clone().fill_(x.shape[0]))
    with pytest.raises(OpArgumentError, match="perm holds tokens outside"):
        CpuShrink.prepare(bad, layer.a, x.shape[0])
    with pytest.raises(OpArgumentError, match="perm holds tokens outside"):
        CpuExpand.prepare(bad, layer.b, x.shape[0])


def test_groups_of_one_shape_share_plans_only_when_their_ranks_agree():
    layer, token_slots, x, out = _case("uniform", 1, torch.float32)
    segments = segments_from_slots(token_slots)
    first_s = CpuShrink.prepare(layer.meta(segments), layer.a, x.shape[0])
    first_e = CpuExpand.prepare(layer.meta(segments), layer.b, x.shape[0])
    other_a, other_b = layer.a.flip(0).contiguous(), layer.b.flip(0).contiguous()
    same_s = CpuShrink.prepare(layer.meta(segments), other_a, x.shape[0], like=first_s)
    same_e = CpuExpand.prepare(layer.meta(segments), other_b, x.shape[0], like=first_e)
    assert same_s.plan is first_s.plan and same_e.plan is first_e.plan
    got = out.clone()
    with torch.inference_mode():
        v = same_s.apply(x)
        same_e.apply(got, v)
    meta = layer.meta(segments)
    _assert_close(v, shrink_reference(x, other_a, meta))
    _assert_close(got, expand_reference(out, v, other_b, meta))
    unused = layer.meta(segments)._replace(slot_ranks=torch.zeros_like(layer.slot_ranks))
    empty_e = CpuExpand.prepare(unused, layer.b, x.shape[0], like=first_e)
    assert empty_e.plan is not first_e.plan and empty_e.empty and not first_e.empty
