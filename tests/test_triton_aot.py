"""The Triton kernels built for an H100/H200 (sm_90) on this machine, with no GPU.

The interpreter tests (``test_ops_triton.py``) check what the kernels compute; these check that every
specialization the launchers pick compiles through Triton's real pipeline down to a cubin (``ptxas``
included), with no register spills and shared memory within the chip's limit: the failures that would
otherwise first show on a GPU. bf16 is covered here, which the interpreter cannot run.
"""

from __future__ import annotations

import pytest
import torch

from lora_pin.ops import random_layer, request_slots, segments_from_slots

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


def _launches(dtype, hidden, widths, rank, n_requests, tokens, chunk_size):
    gen = torch.Generator().manual_seed(0)
    layer = random_layer(8, hidden, widths, [rank], dtype, gen)
    token_slots = torch.repeat_interleave(request_slots("uniform", n_requests, 8, gen), tokens)
    batch = segments_from_slots(token_slots, chunk_size)
    x = torch.randn(token_slots.shape[0], hidden, generator=gen).to(dtype)
    out = torch.zeros(token_slots.shape[0], sum(widths), dtype=dtype)
    n_slices = len(widths)
    split = triton_sgmv.shrink_split_k(hidden, batch.seg_slots.shape[0], n_slices, rank, dtype, 2 * H200_SMS)
    v = x.new_zeros(x.shape[0], n_slices * rank, dtype=torch.float32 if split > 1 else dtype)
    shrink = triton_sgmv.shrink_launch(
        x, layer.a, v, *batch, layer.slot_ranks, n_slices, rank, split, interpret=False
    )
    v = x.new_zeros(x.shape[0], n_slices * rank)
    expand = triton_sgmv.expand_launch(out, v, layer.b, *batch, *layer[2:], rank, interpret=False)
    return shrink, expand


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{str(s[0])[6:]}-x{len(s[2])}-r{s[3]}-{s[4]}x{s[5]}")
def test_every_launch_builds_for_sm90_without_spills(shape):
    for launch in _launches(*shape):
        build = triton_aot.compile_launch(launch, arch=90)
        assert build.name == launch.kernel.__name__
        assert build.local_bytes == 0, f"{build.name} {build.constexprs} spills {build.local_bytes} B"
        assert 0 < build.shared_bytes <= triton_aot.MAX_SHARED_BYTES[90], build
        assert build.registers <= 255
        assert build.fits


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
    v = triton_sgmv.sgmv_shrink(x, layer.a, *batch, layer.slot_ranks, 1, interpret=True)
    want = torch.stack(
        [x[i] @ layer.a[s].T if s >= 0 else torch.zeros(16) for i, s in enumerate(token_slots)]
    )
    torch.testing.assert_close(v, want, atol=1e-4, rtol=1e-4)
