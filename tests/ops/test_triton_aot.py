"""The Triton kernels built for an H100/H200 (sm_90) on this machine, with no GPU.

The interpreter tests (``test_triton_sgmv.py``) check what the kernels compute; these check that every
specialization the launchers pick compiles through Triton's real pipeline down to a cubin (``ptxas``
included), with no register spills and shared memory within the chip's limit: the failures that would
otherwise first show on a GPU. bf16 is covered here, which the interpreter cannot run.
"""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import random_layer, request_slots
from lora_pin.ops import lora_reference, segments_from_slots

triton_sgmv = pytest.importorskip("lora_pin.ops.triton_sgmv")
triton_aot = pytest.importorskip("lora_pin.ops.triton_aot")

pytestmark = pytest.mark.triton

H200_SMS = 132

# (dtype, hidden, slice widths, max rank, requests, tokens per request, chunk size). Every dtype, row
# tile and rank tile the launchers choose: decode (one-token segments: BLOCK_M 16, split-K), 30- and
# 100-token segments (BLOCK_M 32 and 64, no split), ranks 8 (BLOCK_R 16, strides not multiples of 16),
# 32 and 64; then fused q/k/v under GQA, gate/up, and rank 128 (two rank blocks).
REGIMES = [(64, 1, 16), (8, 30, None), (4, 100, None)]
SHAPES = [
    (dtype, 2048, [2048], rank, *regime)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for rank in (8, 32, 64)
    for regime in REGIMES
] + [
    (torch.bfloat16, 4096, [4096, 1024, 1024], 64, 8, 1, 16),
    (torch.bfloat16, 2048, [5632, 5632], 8, 2, 300, None),
    (torch.bfloat16, 2048, [2048], 128, 4, 40, None),
]
DECODE, PREFILL, RANK_128 = SHAPES[3], SHAPES[-2], SHAPES[-1]


def _inputs(dtype, hidden, widths, rank, n_requests, tokens, chunk_size):
    """A pool of rank ``rank`` holding mixed ranks (full, a quarter, 0, and for fused layers a slot with
    absent slices), a fifth of the requests (at least one) on the base model, ``tokens`` tokens each."""
    gen = torch.Generator().manual_seed(0)
    n_slices = len(widths)
    ranks = [rank, max(1, rank // 4), 0] + ([(rank,) + (0,) * (n_slices - 1)] if n_slices > 1 else [])
    layer = random_layer(8, hidden, widths, ranks, dtype, gen, max_rank=rank)
    slots = request_slots("uniform", n_requests, 8, gen, base_fraction=max(0.2, 1 / n_requests))
    token_slots = torch.repeat_interleave(slots, tokens)
    batch = segments_from_slots(token_slots, chunk_size)
    x = torch.randn(token_slots.shape[0], hidden, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], sum(widths), generator=gen).to(dtype)
    return layer, token_slots, batch, x, out


def _shrink(layer, batch, x):
    """The shrink launch the CUDA op would make on an H200 (its ``v`` is ``args[2]``)."""
    n_slices = len(layer.slice_offsets) - 1
    rank = layer.a.shape[1] // n_slices
    segments = batch.seg_slots.shape[0]
    split = triton_sgmv.shrink_split_k(x.shape[1], segments, n_slices, rank, x.dtype, 2 * H200_SMS)
    v = x.new_zeros(x.shape[0], n_slices * rank, dtype=torch.float32 if split > 1 else x.dtype)
    return triton_sgmv.shrink_launch(x, layer.a, v, layer.meta(batch), rank, split, interpret=False)


def _expand(layer, batch, v, out):
    """The expand launch the CUDA op would make on an H200."""
    rank = layer.b.shape[2]
    return triton_sgmv.expand_launch(out, v, layer.b, layer.meta(batch), rank, interpret=False)


def _launches(*shape):
    layer, _, batch, x, out = _inputs(*shape)
    return _shrink(layer, batch, x), _expand(layer, batch, x.new_zeros(x.shape[0], layer.a.shape[1]), out)


def _id(shape) -> str:
    return f"{str(shape[0])[6:]}-x{len(shape[2])}-r{shape[3]}-{shape[4]}x{shape[5]}"


# The interpreter has no bf16 arithmetic: the fp16 and fp32 shapes, and the special ones in fp16.
INTERPRETED = [s for s in SHAPES if s[0] != torch.bfloat16] + [(torch.float16, *s[1:]) for s in SHAPES[-3:]]


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_every_launch_builds_for_sm90_without_spills(shape):
    for launch in _launches(*shape):
        build = triton_aot.compile_launch(launch, arch=90)
        assert build.name == launch.kernel.__name__
        assert build.local_bytes == 0, f"{build.name} {build.constexprs} spills {build.local_bytes} B"
        assert 0 < build.shared_bytes <= triton_aot.MAX_SHARED_BYTES[90], build
        assert build.registers <= 255
        assert build.fits


@pytest.mark.parametrize("shape", INTERPRETED, ids=_id)
def test_the_sm90_launches_equal_the_reference_under_the_interpreter(shape):
    # The interpreter tests in test_triton_sgmv.py use small tiles; these run the GPU's own tile sizes,
    # split-K and row tiles, as built above, on the same inputs.
    layer, token_slots, batch, x, out = _inputs(*shape)
    shrink = _shrink(layer, batch, x)
    shrink.run(interpret=True)
    got = out.clone()
    _expand(layer, batch, shrink.args[2].to(x.dtype), got).run(interpret=True)
    want = lora_reference(out, x, layer.a, layer.b, token_slots, *layer[2:])
    tol = {torch.float32: 1e-4, torch.float16: 5e-3}[x.dtype] * want.abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=0)
    base = token_slots < 0
    assert base.any() and torch.equal(got[base], out[base]), "a base-model row was touched"


def test_the_launchers_pick_the_regimes_the_shapes_claim():
    shrink, expand = _launches(*DECODE)  # 64 one-token segments
    assert shrink.constexprs["BLOCK_M"] == 16 and shrink.constexprs["SPLIT_K"] > 1
    assert shrink.args[2].dtype == torch.float32  # split-K accumulates with fp32 atomics
    shrink, expand = _launches(*PREFILL)  # two segments of 300 tokens
    assert shrink.constexprs["BLOCK_M"] == 64 and expand.constexprs["BLOCK_M"] == 64
    shrink, _ = _launches(*RANK_128)
    assert shrink.constexprs["RANK_BLOCKS"] == 2


def test_a_kernel_that_spills_is_reported():
    # The check must be able to fail: a shrink tile far too large for the registers spills.
    shrink, _ = _launches(torch.float32, 2048, [2048], 64, 4, 100, None)
    big = triton_sgmv.KernelLaunch(
        shrink.kernel, shrink.grid, shrink.args, {**shrink.constexprs, "BLOCK_M": 128, "BLOCK_K": 128}
    )
    build = triton_aot.compile_launch(big, arch=90)
    assert build.local_bytes > 0
    assert not build.fits


def test_building_leaves_triton_without_a_gpu_driver_and_the_interpreter_working():
    from triton.runtime.driver import driver

    before = driver._active
    triton_aot.compile_launch(_launches(*DECODE)[1], arch=90)
    assert driver._active is before
    gen = torch.Generator().manual_seed(1)
    layer = random_layer(2, 32, [32], [16], torch.float32, gen)
    token_slots = torch.tensor([0, 1, 1, -1])
    batch = segments_from_slots(token_slots, None)
    x = torch.randn(4, 32, generator=gen)
    v = triton_sgmv.sgmv_shrink(x, layer.a, layer.meta(batch), interpret=True)
    want = torch.stack(
        [x[i] @ layer.a[s].T if s >= 0 else torch.zeros(16) for i, s in enumerate(token_slots)]
    )
    torch.testing.assert_close(v, want, atol=1e-4, rtol=1e-4)
