"""The Triton SGMV kernels against the float64 reference.

On CPU they run under the Triton interpreter, called through ``lora_pin.ops.triton_sgmv`` with CPU
tensors: the launchers wrap the kernels for the interpreter themselves, so ``TRITON_INTERPRET`` is never
set and ``triton.jit`` keeps compiling for everyone else in the process. The interpreter has no bf16
arithmetic, so fp32 and fp16 only, on tiny shapes. The CUDA tests at the end run where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import PATTERNS, random_layer, request_slots
from lora_pin.ops import (
    OpArgumentError,
    expand_reference,
    lora_reference,
    segments_from_slots,
    shrink_reference,
)

triton_sgmv = pytest.importorskip("lora_pin.ops.triton_sgmv")

pytestmark = pytest.mark.triton

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _case(
    pattern, dtype, seed, *, ranks=(16,), slice_widths=(40, 8, 8), n_requests=10, tokens=2, device="cpu"
):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(6, 48, list(slice_widths), list(ranks), dtype, gen, device=device)
    slots = request_slots(pattern, n_requests, 6, gen, base_fraction=0.2)
    token_slots = torch.repeat_interleave(slots, tokens)
    x = torch.randn(token_slots.shape[0], 48, generator=gen).to(device=device, dtype=dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(
        device=device, dtype=dtype
    )
    return layer, token_slots.to(device), x, out


def _run(layer, token_slots, x, out, chunk_size, **launch):
    """shrink then expand through the Triton launchers; returns (v, new out)."""
    batch = segments_from_slots(token_slots, chunk_size)
    v = triton_sgmv.sgmv_shrink(x, layer.a, layer.meta(batch), **launch)
    got = out.clone()
    triton_sgmv.sgmv_expand(got, v, layer.b, layer.meta(batch), interpret=launch.get("interpret"))
    return batch, v, got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_shrink_and_expand_match_the_reference(pattern, dtype):
    layer, token_slots, x, out = _case(pattern, dtype, PATTERNS.index(pattern))
    batch, v, got = _run(layer, token_slots, x, out, chunk_size=4)
    _assert_close(v, shrink_reference(x, layer.a, layer.meta(batch)))
    _assert_close(got, expand_reference(out, v, layer.b, layer.meta(batch)))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    base = token_slots < 0
    assert torch.equal(_bits(got[base]), _bits(out[base])), "rows without adapter must be untouched"


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_and_long_segments(split_k, dtype):
    # Unchunked segments longer than BLOCK_M loop over row blocks; split-K accumulates with atomics.
    layer, token_slots, x, out = _case("zipf", dtype, 11, n_requests=6, tokens=7)
    batch, v, got = _run(layer, token_slots, x, out, chunk_size=None, split_k=split_k)
    _assert_close(v, shrink_reference(x, layer.a, layer.meta(batch)))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_ranks_absent_slices_and_rank_blocks(dtype):
    # Ranks 1..64 in one batch over a rank-64 pool; slot 4 is a no-op, slot 5 lacks its k and v slices.
    ranks = [1, 8, 16, 64, 0, (64, 0, 0)]
    layer, token_slots, x, out = _case(
        "uniform", dtype, 12, ranks=ranks, slice_widths=(64, 16, 16), n_requests=14
    )
    batch, v, got = _run(layer, token_slots, x, out, chunk_size=3)
    want_v = shrink_reference(x, layer.a, layer.meta(batch))
    _assert_close(v, want_v)
    assert torch.equal(v == 0, want_v == 0), "columns past each rank and uncovered rows must be exactly zero"
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    untouched = (token_slots == -1) | (token_slots == 4)
    assert torch.equal(_bits(got[untouched]), _bits(out[untouched]))


def test_ranks_above_one_rank_block():
    # R = 80 takes two rank blocks of 64 in shrink and two rank steps in expand; rank 8 exits block 2.
    layer, token_slots, x, out = _case("uniform", torch.float32, 18, ranks=[80, 8, (70, 0, 65)])
    batch, v, got = _run(layer, token_slots, x, out, chunk_size=4)
    _assert_close(v, shrink_reference(x, layer.a, layer.meta(batch)))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


def test_weights_past_the_rank_are_never_loaded():
    layer, token_slots, x, out = _case("distinct", torch.float32, 13, ranks=[4, 16, 0])
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    for s in range(3):
        layer.a[0, s * 16 + 4 : (s + 1) * 16] = float("nan")
    layer.b[0, :, 4:] = float("nan")
    layer.a[2] = float("nan")
    layer.b[2] = float("nan")
    _, _, got = _run(layer, token_slots, x, out, chunk_size=2)
    _assert_close(got, want)


def test_single_slice_and_empty_batches():
    layer, token_slots, x, out = _case("skewed", torch.float32, 14, slice_widths=(24,))
    _, _, got = _run(layer, token_slots, x, out, chunk_size=4)
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    nobody = torch.full_like(token_slots, -1)
    _, v, got = _run(layer, nobody, x, out, chunk_size=4)
    assert not v.any() and torch.equal(got, out)


def test_compiled_kernels_need_cuda_tensors():
    layer, token_slots, x, _ = _case("uniform", torch.float32, 15)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        triton_sgmv.sgmv_shrink(x, layer.a, layer.meta(segments_from_slots(token_slots)), interpret=False)


def test_the_interpreter_leaves_triton_jit_compiling():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_sgmv._launchable(triton_sgmv._sgmv_shrink_kernel, True), InterpretedFunction)
    assert not isinstance(
        triton_sgmv._launchable(triton_sgmv._sgmv_shrink_kernel, False), InterpretedFunction
    )


def _hopper_signature(kernel, pointers, constexprs):
    """Every argument of the kernel typed as the launcher passes it: pointers as given, ints as i32."""
    import inspect

    names = inspect.signature(kernel).parameters
    return {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in names}


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_kernels_compile_for_hopper_without_a_gpu(dtype):
    # The interpreter never runs Triton's compiler: build both kernels for sm_90 (ptxas ships in the
    # wheel), with the launchers' options, so a kernel that only the compiler rejects fails here too.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    precision = "ieee" if dtype == "fp32" else "tf32"
    index = {"perm_ptr": "*i64", "seg_indptr_ptr": "*i32", "seg_slots_ptr": "*i32", "slot_ranks_ptr": "*i32"}
    kernels = [
        (
            triton_sgmv._sgmv_shrink_kernel,
            {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "v_ptr": "*fp32", **index},
            dict(
                N_SLICES=3,
                RANK_BLOCKS=2,
                SPLIT_K=4,
                BLOCK_M=32,
                BLOCK_R=64,
                BLOCK_K=64,
                DOT_PRECISION=precision,
            ),
        ),
        (
            triton_sgmv._sgmv_expand_kernel,
            {
                "out_ptr": f"*{dtype}",
                "v_ptr": f"*{dtype}",
                "b_ptr": f"*{dtype}",
                "slot_scalings_ptr": "*fp32",
                **index,
            },
            dict(N_SLICES=3, BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, DOT_PRECISION=precision),
        ),
    ]
    for kernel, pointers, constexprs in kernels:
        source = ASTSource(
            fn=triton.jit(kernel),
            signature=_hopper_signature(kernel, pointers, constexprs),
            constexprs=constexprs,
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options=triton_sgmv._COMPILE_OPTIONS
        )
        assert "cubin" in compiled.asm


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_ops_match_the_reference(pattern, dtype):
    from lora_pin.ops import lora_delta_

    layer, token_slots, x, out = _case(pattern, dtype, 16, ranks=[8, 16, 64, (16, 0, 8)], device="cuda")
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(segments_from_slots(token_slots, 16)))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    base = token_slots < 0
    assert torch.equal(_bits(got[base]), _bits(out[base]))


@cuda
def test_cuda_ops_never_synchronise_and_replay_in_a_cuda_graph():
    from lora_pin.ops import lora_delta_

    layer, token_slots, x, out = _case("zipf", torch.float16, 17, device="cuda")
    batch = segments_from_slots(token_slots, 16)
    work = out.clone()
    lora_delta_(work, x, layer.a, layer.b, layer.meta(batch))  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lora_delta_(work, x, layer.a, layer.b, layer.meta(batch))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    work.copy_(out)
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(work, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


def test_the_interpreter_checks_what_the_segment_arrays_hold_and_refuses_bf16():
    # It indexes host memory with whatever they hold: a bad index would read or write out of bounds.
    layer, token_slots, x, out = _case("uniform", torch.float32, 3)
    meta = layer.meta(segments_from_slots(token_slots, None))
    far = meta.perm.clone()
    far[0] = 10**9
    with pytest.raises(OpArgumentError, match="perm holds tokens outside"):
        triton_sgmv.sgmv_shrink(x, layer.a, meta._replace(perm=far))
    with pytest.raises(OpArgumentError, match="seg_slots must lie in"):
        triton_sgmv.sgmv_expand(
            out,
            torch.zeros(out.shape[0], layer.a.shape[1]),
            layer.b,
            meta._replace(seg_slots=torch.full_like(meta.seg_slots, 10**6)),
        )
    with pytest.raises(OpArgumentError, match="bf16"):
        triton_sgmv.sgmv_shrink(x.bfloat16(), layer.a.bfloat16(), meta)
