"""The lora_pin custom ops on CPU: correctness, contract, opcheck, torch.compile.

Every test runs twice: with the native CPU kernels (``rust/kernels/src/sgmv``, decode-sized slots) and with
the grouped torch path alone (``LORA_PIN_CPU_KERNELS=0``).
"""

from __future__ import annotations

import platform

import pytest
import torch

from lora_pin._testing import PATTERNS, random_layer, request_slots
from lora_pin.errors import LoraPinError
from lora_pin.ops import (
    KernelMeta,
    OpArgumentError,
    expand,
    expand_reference,
    grouped,
    lora_delta_,
    lora_reference,
    segments_from_slots,
    shrink,
    shrink_reference,
)

# Against a float64 reference, with O(1) values: peers use fp16 ~1e-3..5e-3 and bf16 ~2e-2..3e-2.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
QKV_GQA = [64, 16, 16]  # q, k, v output widths under grouped-query attention


pytestmark = pytest.mark.usefixtures("cpu_path")  # native kernels, then the torch path (conftest.py)


def test_the_native_kernels_run_wherever_the_cpu_has_avx512(cpu_path):
    # A silent fall back to the torch path on a CPU with AVX-512 would leave the kernels untested; on
    # one without (an AVX2-only CI machine), the torch path is what runs. torch's own reading of the CPU
    # is the independent check.
    if platform.machine() == "x86_64":
        has_avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        assert grouped.sgmv_cpu_available() == has_avx512


def _batch_inputs(
    pattern, phase, dtype, gen, *, slice_widths=QKV_GQA, ranks=(8,), n_slots=12, in_features=48
):
    n_requests, tokens = (24, 1) if phase == "decode" else (5, 23)
    layer = random_layer(n_slots, in_features, slice_widths, list(ranks), dtype, gen)
    slots = request_slots(pattern, n_requests, n_slots, gen, base_fraction=0.25)
    token_slots = torch.repeat_interleave(slots, tokens)
    x = torch.randn(token_slots.shape[0], in_features, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(dtype)
    return layer, token_slots, x, out


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


# --- segments and patterns ---------------------------------------------------------------------


def test_segments_group_by_slot_stably_and_drop_base_rows():
    batch = segments_from_slots(torch.tensor([2, -1, 0, 2, 0, -1, 2]))
    assert batch.perm.tolist() == [2, 4, 0, 3, 6]
    assert batch.seg_indptr.tolist() == [0, 2, 5]
    assert batch.seg_slots.tolist() == [0, 2]
    assert (batch.perm.dtype, batch.seg_indptr.dtype, batch.seg_slots.dtype) == (
        torch.int64,
        torch.int32,
        torch.int32,
    )


def test_segments_are_cut_into_chunks():
    batch = segments_from_slots(torch.tensor([1] * 7 + [0] * 2 + [-1] + [1]), chunk_size=3)
    assert batch.seg_slots.tolist() == [0, 1, 1, 1]
    assert batch.seg_indptr.tolist() == [0, 2, 5, 8, 10]
    assert batch.perm.tolist() == [7, 8, 0, 1, 2, 3, 4, 5, 6, 10]


@pytest.mark.parametrize("token_slots", [[], [-1, -1]])
def test_segments_of_a_batch_without_adapters_are_empty(token_slots):
    batch = segments_from_slots(torch.tensor(token_slots, dtype=torch.int64), chunk_size=4)
    assert batch.perm.numel() == 0 and batch.seg_slots.numel() == 0
    assert batch.seg_indptr.tolist() == [0]


@pytest.mark.parametrize(
    ("token_slots", "chunk_size"),
    [
        (torch.tensor([0.0, 1.0]), None),
        (torch.tensor([[0, 1]]), None),
        (torch.tensor([0, -2]), None),
        (torch.tensor([0]), 0),
    ],
)
def test_segments_reject_bad_input(token_slots, chunk_size):
    with pytest.raises(ValueError):
        segments_from_slots(token_slots, chunk_size)


def test_request_slots_patterns():
    gen = torch.Generator().manual_seed(0)
    assert sorted(request_slots("distinct", 6, 8, gen).tolist()) == [0, 1, 2, 3, 4, 5]
    assert request_slots("identical", 5, 8, gen).tolist() == [0] * 5
    skewed = request_slots("skewed", 16, 8, gen)
    assert (skewed == 0).sum() == 9 and sorted(skewed[skewed > 0].tolist()) == list(range(1, 8))
    assert (request_slots("uniform", 40, 4, gen, base_fraction=0.25) == -1).sum() == 10
    assert torch.equal(
        request_slots("zipf", 30, 8, torch.Generator().manual_seed(3)),
        request_slots("zipf", 30, 8, torch.Generator().manual_seed(3)),
    )
    with pytest.raises(ValueError, match="unknown popularity pattern"):
        request_slots("bursty", 4, 4)


# --- correctness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_lora_delta_matches_the_per_token_reference(pattern, phase, dtype):
    gen = torch.Generator().manual_seed(PATTERNS.index(pattern) * 2 + (phase == "prefill"))
    layer, token_slots, x, out = _batch_inputs(pattern, phase, dtype, gen)
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    for chunk_size in (None, 4):
        got = out.clone()
        lora_delta_(got, x, layer.a, layer.b, layer.meta(segments_from_slots(token_slots, chunk_size)))
        _assert_close(got, want)
        base = token_slots < 0
        assert torch.equal(_bits(got[base]), _bits(out[base])), "rows without adapter must be untouched"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_shrink_and_expand_match_their_segment_references(pattern):
    gen = torch.Generator().manual_seed(7)
    layer, token_slots, x, out = _batch_inputs(pattern, "prefill", torch.float32, gen, ranks=(8, (4, 0, 8)))
    batch = segments_from_slots(token_slots, 8)
    v = shrink(x, layer.a, layer.meta(batch))
    want_v = shrink_reference(x, layer.a, layer.meta(batch))
    _assert_close(v, want_v)
    assert torch.equal(v == 0, want_v == 0), "uncovered rows and columns past the rank must be exactly zero"
    got = out.clone()
    expand(got, v, layer.b, layer.meta(batch))
    _assert_close(got, expand_reference(out, v, layer.b, layer.meta(batch)))


def test_segment_references_compose_to_the_per_token_reference():
    gen = torch.Generator().manual_seed(1)
    layer, token_slots, x, out = _batch_inputs("uniform", "decode", torch.float64, gen, ranks=(1, 8))
    batch = segments_from_slots(token_slots)
    v = shrink_reference(x, layer.a, layer.meta(batch))
    composed = expand_reference(out, v, layer.b, layer.meta(batch))
    torch.testing.assert_close(composed, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_ranks_in_one_batch_use_each_slots_real_rank(dtype):
    gen = torch.Generator().manual_seed(2)
    # Slot 4 has rank 0 everywhere (a no-op); slot 5 lacks its k and v slices.
    ranks = [1, 8, 16, 64, 0, (64, 0, 0)]
    layer = random_layer(6, 96, QKV_GQA, ranks, dtype, gen)
    token_slots = torch.tensor([3, 0, 4, 1, -1, 2, 5, 3, 4, 1, 0, 5, 2, -1] * 3)
    x = torch.randn(token_slots.shape[0], 96, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(dtype)
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(segments_from_slots(token_slots, 4)))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    untouched = (token_slots == -1) | (token_slots == 4)
    assert torch.equal(_bits(got[untouched]), _bits(out[untouched]))
    k_and_v_of_slot_5 = got[token_slots == 5, 64:]
    assert torch.equal(_bits(k_and_v_of_slot_5), _bits(out[token_slots == 5, 64:]))


def test_weights_past_a_slots_rank_are_never_read():
    gen = torch.Generator().manual_seed(3)
    layer = random_layer(3, 32, [40], [4, 16, 0], torch.float32, gen)
    token_slots = torch.tensor([0, 1, 2, 0, 1, 2])
    x, out = torch.randn(6, 32, generator=gen), torch.randn(6, 40, generator=gen)
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    layer.a[0, 4:] = float("nan")  # past slot 0's rank
    layer.b[0, :, 4:] = float("nan")
    layer.a[2] = float("nan")  # slot 2 has rank 0
    layer.b[2] = float("nan")
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(segments_from_slots(token_slots)))
    _assert_close(got, want)


def test_base_segments_in_perm_are_skipped_and_untouched():
    gen = torch.Generator().manual_seed(4)
    layer = random_layer(2, 16, [24], [8], torch.float32, gen)
    x, out = torch.randn(6, 16, generator=gen), torch.randn(6, 24, generator=gen)
    # A planner may keep base-model rows in perm under slot -1.
    batch = KernelMeta(
        perm=torch.tensor([4, 1, 5, 0, 2]),
        seg_indptr=torch.tensor([0, 2, 3, 5], dtype=torch.int32),
        seg_slots=torch.tensor([1, -1, 0], dtype=torch.int32),
    )
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(batch))
    token_slots = torch.tensor([0, 1, 0, -1, 1, -1])
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    assert torch.equal(got[[3, 5]], out[[3, 5]])


def test_runs_gathers_and_merged_chunks_in_one_batch():
    # Slot 0: two long prefill runs (computed on views); slot 1: decode tokens spread over the batch
    # (gathered); slot 2: one run cut into chunks by the planner (merged back).
    token_slots = torch.tensor([0] * 20 + [1] + [2] * 30 + [1] + [0] * 18 + [1, -1, 1])
    gen = torch.Generator().manual_seed(5)
    layer = random_layer(3, 40, [32, 8], [(8, 4), 8, (2, 8)], torch.float32, gen)
    x = torch.randn(token_slots.shape[0], 40, generator=gen)
    out = torch.randn(token_slots.shape[0], 40, generator=gen)
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(segments_from_slots(token_slots, 16)))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slice_widths", [[96], QKV_GQA], ids=["plain", "qkv"])
def test_long_runs_and_gathered_spans_match_the_reference(slice_widths, dtype):
    # Slot 0 in long runs (views; the native kernels' panel expand where out is contiguous), slots 1
    # and 2 interleaved token by token (80 rows each, gathered), slot 3 decode-sized in fp32; ranks 16
    # and 8 (one GEMM per slot) and per-slice ranks (one per slice), beside base rows. In bf16 the
    # shrink of at most 32 columns over 64 rows or more runs as A @ x^T (grouped.shrink_mm).
    token_slots = torch.tensor([0] * 70 + [1, 2] * 80 + [-1] * 5 + [0] * 130 + [3] * 64)
    gen = torch.Generator().manual_seed(11)
    ranks = [16, 8, (16, 0, 4)[: len(slice_widths)], 32]
    layer = random_layer(4, 80, slice_widths, ranks, dtype, gen)
    x = torch.randn(token_slots.shape[0], 80, generator=gen).to(dtype)
    wide = torch.randn(token_slots.shape[0], layer.slice_offsets[-1] + 8, generator=gen).to(dtype)
    want = lora_reference(wide[:, 8:], x, *layer[:2], token_slots, *layer[2:])
    meta = layer.meta(segments_from_slots(token_slots, 32))
    v = shrink(x, layer.a, meta)
    want_v = shrink_reference(x, layer.a, meta)
    _assert_close(v, want_v)
    assert torch.equal(v == 0, want_v == 0), "uncovered rows and columns past the rank must be exactly zero"
    for out in (wide[:, 8:].contiguous(), wide.clone()[:, 8:]):  # contiguous, then strided (BLAS)
        before = out.clone()
        lora_delta_(out, x, layer.a, layer.b, meta)
        _assert_close(out, want)
        assert torch.equal(_bits(out[token_slots < 0]), _bits(before[token_slots < 0]))
        out.copy_(before)
        expand(out, v, layer.b, meta)
        _assert_close(out, want)


def test_strided_inputs_and_outputs():
    gen = torch.Generator().manual_seed(6)
    layer = random_layer(4, 24, [16, 16], [8], torch.float32, gen)
    token_slots = torch.tensor([3, 0, -1, 3, 2, 1, 0])
    x = torch.randn(24, 7, generator=gen).T  # column-major
    wide = torch.randn(7, 50, generator=gen)
    out = wide[:, 5:37]  # row stride 50
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    lora_delta_(out, x, layer.a, layer.b, layer.meta(segments_from_slots(token_slots)))
    _assert_close(out, want)


# --- the native kernels ---------------------------------------------------------------------------------


def test_decode_slots_go_to_the_native_kernels_and_long_ones_stay_on_torch(cpu_path):
    from lora_pin.ops.grouped import _KERNEL_MAX_TOKENS, _PLANS

    # Slot 0: one token; slot 1: three spread over the batch; slot 2: a prefill run past the limit.
    long = _KERNEL_MAX_TOKENS[torch.float32] + 1
    token_slots = torch.tensor([0, 1, -1, 1] + [2] * long + [1])
    batch = segments_from_slots(token_slots, 4)
    ranks = torch.full((3, 3), 8, dtype=torch.int32)
    plan = _PLANS.get(
        KernelMeta(*batch[:3], ranks, 3), token_slots.shape[0], 8, torch.float32, grouped.use_cpu_kernels
    )
    if cpu_path == "native":
        assert plan.kernel is not None and plan.kernel.n_rows == 4
        assert [(r.slot, r.size) for r in plan.runs] == [(2, long)]
    else:
        assert plan.kernel is None


def test_a_repeated_token_is_refused():
    layer, batch, x, out = _small_case()
    perm = batch.perm.clone()
    perm[1] = perm[0]
    meta = layer.meta(batch)._replace(perm=perm)
    _expect_error(lambda: shrink(x, layer.a, meta), "perm repeats token")
    v = torch.zeros(8, 12)
    _expect_error(lambda: expand(out, v, layer.b, meta), "perm repeats token")


# --- the batched decode path and the plan cache ---------------------------------------------------


def _dense_blocks(token_slots, layer, dtype):
    """White box: the batched path's blocks for this batch, as (first slot, slots, tokens per slot)."""
    from lora_pin.ops.grouped import _PLANS

    batch = segments_from_slots(token_slots, 2)
    max_rank = layer.b.shape[2]
    plan = _PLANS.get(layer.meta(batch), token_slots.shape[0], max_rank, dtype)
    return [(d.first_slot, d.n_slots, d.tokens_per_slot) for d in plan.dense], batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_full_decode_block_runs_batched_and_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(9)
    layer = random_layer(6, 64, QKV_GQA, [8], dtype, gen)
    token_slots = torch.tensor([3, -1, 0, 5, 1, -1, 4, 2])
    blocks, batch = _dense_blocks(token_slots, layer, dtype)
    assert blocks == [(0, 6, 1)]
    x = torch.randn(8, 64, generator=gen).to(dtype)
    out = torch.randn(8, layer.slice_offsets[-1], generator=gen).to(dtype)
    v = shrink(x, layer.a, layer.meta(batch))
    want_v = shrink_reference(x, layer.a, layer.meta(batch))
    _assert_close(v, want_v)
    assert torch.equal(v == 0, want_v == 0)
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(batch))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))
    base = token_slots < 0
    assert torch.equal(_bits(got[base]), _bits(out[base]))


@pytest.mark.parametrize(
    ("dtype", "token_slots", "block"),
    [
        # Every slot of 1..5 holds two tokens: padded rows = real rows.
        (torch.float32, [1, 2, 0, 3, 4, 5, 0, 1, 2, 0, 3, -1, 4, 5, 0, 0], (1, 5, 2)),
        # bf16 allows idle slots in the block: slot 3 is idle, slot 0 is too busy to be batched.
        (torch.bfloat16, [1, 2, 0, 4, 5, 0, 1, 2, 0, -1, 4, 5, 0, 0], (1, 5, 2)),
    ],
    ids=["fp32-two-tokens", "bf16-idle-slot"],
)
def test_a_padded_block_beside_a_busy_slot_never_reads_past_rank_or_idle_slots(dtype, token_slots, block):
    gen = torch.Generator().manual_seed(10)
    # Slot 0 has rank 8 (so R = 8); slots 1..5 share rank 4, so the block stops at column 4.
    layer = random_layer(6, 40, [24, 8], [8, 4, 4, 4, 4, 4], dtype, gen)
    token_slots = torch.tensor(token_slots)
    blocks, batch = _dense_blocks(token_slots, layer, dtype)
    assert blocks == [block]
    x = torch.randn(token_slots.shape[0], 40, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], 32, generator=gen).to(dtype)
    want = lora_reference(out, x, *layer[:2], token_slots, *layer[2:])
    for slot in range(1, 6):
        for s in range(2):
            layer.a[slot, s * 8 + 4 : s * 8 + 8] = float("nan")
        layer.b[slot, :, 4:] = float("nan")
    if 3 not in token_slots.tolist():
        layer.a[3] = float("nan")
        layer.b[3] = float("nan")
    v = shrink(x, layer.a, layer.meta(batch))
    assert not v.isnan().any()
    got = out.clone()
    expand(got, v, layer.b, layer.meta(batch))
    _assert_close(got, want)
    base = token_slots < 0
    assert torch.equal(_bits(got[base]), _bits(out[base]))


def test_mixed_ranks_split_into_one_block_per_rank():
    gen = torch.Generator().manual_seed(11)
    layer = random_layer(8, 32, [16, 16], [4, 4, 4, 4, 8, 8, 8, 8], torch.float32, gen)
    token_slots = torch.tensor([0, 3, 1, 3, 2, 3, 4, 3, 5, 3, 6, 7])
    blocks, batch = _dense_blocks(token_slots, layer, torch.float32)
    assert sorted(blocks) == [(0, 3, 1), (4, 4, 1)]  # slot 3 (six tokens) is left to the grouped path
    x, out = torch.randn(12, 32, generator=gen), torch.randn(12, 32, generator=gen)
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(batch))
    _assert_close(got, lora_reference(out, x, *layer[:2], token_slots, *layer[2:]))


def test_plans_are_cached_by_content_so_a_buffer_refilled_in_place_is_replanned():
    gen = torch.Generator().manual_seed(12)
    layer = random_layer(4, 16, [8], [4], torch.float32, gen)
    x, out = torch.randn(6, 16, generator=gen), torch.randn(6, 8, generator=gen)
    first, second = torch.tensor([0, 1, 2, 3, 0, 1]), torch.tensor([3, 3, 1, 0, 2, 2])
    batch = segments_from_slots(first)
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(batch))
    _assert_close(got, lora_reference(out, x, *layer[:2], first, *layer[2:]))
    # The planner's next step reuses the same tensors; numpy writes do not bump torch's version counter.
    refilled = segments_from_slots(second)
    for old, new in zip(batch[:3], refilled[:3], strict=True):
        assert old.shape == new.shape
        old.numpy()[:] = new.numpy()
    got = out.clone()
    lora_delta_(got, x, layer.a, layer.b, layer.meta(batch))
    _assert_close(got, lora_reference(out, x, *layer[:2], second, *layer[2:]))


# --- contract ----------------------------------------------------------------------------------


def _small_case(dtype=torch.float32):
    gen = torch.Generator().manual_seed(8)
    layer = random_layer(3, 16, [12, 4, 4], [4, (2, 0, 4)], dtype, gen)
    token_slots = torch.tensor([2, -1, 0, 1, 0, 2, 2, -1])
    x = torch.randn(8, 16, generator=gen).to(dtype)
    out = torch.randn(8, 20, generator=gen).to(dtype)
    return layer, segments_from_slots(token_slots, 2), x, out


def test_ops_are_registered_in_the_lora_pin_namespace():
    layer, batch, x, out = _small_case()
    v = torch.ops.lora_pin.shrink(x, layer.a, *batch[:3], layer.slot_ranks, 3)
    assert torch.equal(v, shrink(x, layer.a, layer.meta(batch)))
    via_op, via_python = out.clone(), out.clone()
    torch.ops.lora_pin.expand(via_op, v, layer.b, *batch[:3], *layer[2:])
    expand(via_python, v, layer.b, layer.meta(batch))
    assert torch.equal(via_op, via_python) and not torch.equal(via_op, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    layer, batch, x, out = _small_case(dtype)
    torch.library.opcheck(torch.ops.lora_pin.shrink.default, (x, layer.a, *batch[:3], layer.slot_ranks, 3))
    v = shrink(x, layer.a, layer.meta(batch))
    torch.library.opcheck(torch.ops.lora_pin.expand.default, (out, v, layer.b, *batch[:3], *layer[2:]))


class _LoRALinear(torch.nn.Module):
    """A fused q/k/v projection with per-token adapters, as a model integration would call the ops."""

    def __init__(self, layer):
        super().__init__()
        self.base = torch.nn.Linear(layer.a.shape[2], layer.slice_offsets[-1], dtype=layer.a.dtype)
        self.register_buffer("a", layer.a)
        self.register_buffer("b", layer.b)
        self.register_buffer("slot_ranks", layer.slot_ranks)
        self.register_buffer("slot_scalings", layer.slot_scalings)
        self.slice_offsets = layer.slice_offsets

    def forward(self, x, perm, seg_indptr, seg_slots):
        y = self.base(x)
        segments = KernelMeta(perm, seg_indptr, seg_slots)
        meta = KernelMeta.for_layer(segments, self.slot_ranks, self.slot_scalings, self.slice_offsets)
        expand(y, shrink(x, self.a, meta), self.b, meta)
        return torch.nn.functional.silu(y)


def _check_compiled(backend):
    layer, batch, x, _ = _small_case()
    module = _LoRALinear(layer)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    other = segments_from_slots(torch.tensor([0, 0, 1, -1, 2, 1, 0, 2]), 3)
    with torch.no_grad():
        for segments in (batch, other):
            torch.testing.assert_close(compiled(x, *segments[:3]), module(x, *segments[:3]))


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_fullgraph():
    _check_compiled("aot_eager")


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_fullgraph_inductor():
    _check_compiled("inductor")


def _expect_error(fn, match):
    with pytest.raises(OpArgumentError, match=match) as info:
        fn()
    assert isinstance(info.value, LoraPinError) and isinstance(info.value, ValueError)


def test_bad_arguments_are_named():
    layer, batch, x, out = _small_case()
    a, b, ranks, scalings, _ = layer
    meta = layer.meta(batch)
    v = shrink(x, a, meta)
    _expect_error(lambda: shrink(x.half(), a, meta), "a must be torch.float16")
    _expect_error(lambda: shrink(x, a, meta._replace(n_slices=5)), "not a multiple of n_slices")
    _expect_error(lambda: shrink(x, a, meta._replace(perm=batch.perm.int())), "perm must be int64")
    _expect_error(lambda: shrink(x, a, meta._replace(seg_slots=batch.seg_slots[:-1])), "seg_slots")
    _expect_error(lambda: shrink(x[:2], a, meta), "perm has 6 rows")
    rising = KernelMeta.for_layer(batch, ranks, scalings, [0, 12, 16, 19])
    _expect_error(lambda: expand(out, v, b, rising), "slice_offsets must rise")
    _expect_error(lambda: expand(out, v, b, meta._replace(slot_scalings=scalings.double())), "slot_scalings")
    _expect_error(lambda: expand(out, v[:, :8], b, meta), "v must be")
    too_many = KernelMeta.for_layer(batch, ranks, scalings, [0, *[1] * 9, 20])
    _expect_error(lambda: expand(out, v, b, too_many), "slice_offsets must hold")
    shrink_only = KernelMeta(*batch[:3], ranks, 3)
    _expect_error(lambda: expand(out, v, b, shrink_only), "expand needs slot_scalings and slice_offsets")
    _expect_error(lambda: expand(out, v, b, meta._replace(n_slices=2)), "n_slices=2 but slice_offsets")
    # A step's segments alone are one KernelMeta too, but no op takes them without a layer's fields.
    _expect_error(lambda: shrink(x, a, batch), "segments alone")
    _expect_error(lambda: expand(out, v, b, batch), "expand needs slot_scalings")
    assert meta.segments().perm is batch.perm and meta.segments().slot_ranks is None


def test_expand_refuses_to_drop_a_gradient_silently():
    layer, batch, x, out = _small_case()
    v = shrink(x.requires_grad_(), layer.a, layer.meta(batch))
    _expect_error(lambda: expand(out, v, layer.b, layer.meta(batch)), "no autograd formula")
    with torch.no_grad():
        expand(out, v, layer.b, layer.meta(batch))
    v = v.detach()
    b = layer.b.clone().requires_grad_()
    _expect_error(lambda: expand(out, v, b, layer.meta(batch)), "no autograd formula")
    base = out.clone().requires_grad_() * 1.0  # a non-leaf base output in a graph
    _expect_error(lambda: expand(base, v, layer.b, layer.meta(batch)), "no autograd formula")


def test_expand_refuses_an_out_that_overlaps_what_it_reads():
    layer, batch, x, out = _small_case()
    v = shrink(x, layer.a, layer.meta(batch))
    shared = torch.zeros(out.shape[0], out.shape[1])
    # v's columns are out's first ones: the add would read what it has just written.
    _expect_error(
        lambda: expand(shared, shared[:, : v.shape[1]], layer.b, layer.meta(batch)), "out overlaps v"
    )
    assert not shared.any(), "the refused call wrote"
    memory = torch.zeros(3 * 20 * 4)
    b, out_in_b = memory.view(3, 20, 4), memory[:160].view(8, 20)
    _expect_error(lambda: expand(out_in_b, v, b, layer.meta(batch)), "out overlaps b")


def test_slice_offsets_must_be_ints():
    layer, batch, x, out = _small_case()
    v = shrink(x, layer.a, layer.meta(batch))
    floats = layer.meta(batch)._replace(slice_offsets=(0, 12.0, 16, 20))
    _expect_error(lambda: expand(out, v, layer.b, floats), "must be ints")


def test_fp16_expand_of_large_activations_does_not_overflow():
    # v * scaling = 80000 passes fp16's largest value (65504); the result, 80, does not.
    out = torch.zeros(2, 4, dtype=torch.float16)
    v = torch.full((2, 1), 40000.0, dtype=torch.float16)
    b = torch.full((2, 4, 1), 1e-3, dtype=torch.float16)
    ranks, scalings = torch.ones(2, 1, dtype=torch.int32), torch.full((2, 1), 2.0)
    batch = segments_from_slots(torch.tensor([0, 1]))  # one token a slot: the batched decode path
    meta = KernelMeta.for_layer(batch, ranks, scalings, [0, 4])
    got = out.clone()
    expand(got, v, b, meta)
    want = expand_reference(out, v, b, meta)
    assert torch.isfinite(got).all(), got
    _assert_close(got, want)


def test_bad_segment_contents_are_refused_on_cpu():
    layer, batch, x, _ = _small_case()
    too_high = layer.slot_ranks.clone()
    too_high[0, 0] = 5
    meta = layer.meta(batch)
    _expect_error(lambda: shrink(x, layer.a, meta._replace(slot_ranks=too_high)), "slot_ranks must lie in")
    bad_slots = batch.seg_slots.clone()
    bad_slots[0] = 3
    _expect_error(lambda: shrink(x, layer.a, meta._replace(seg_slots=bad_slots)), "seg_slots")
    bad_perm = batch.perm.clone()
    bad_perm[0] = 8
    _expect_error(lambda: shrink(x, layer.a, meta._replace(perm=bad_perm)), "perm holds tokens")
    bad_indptr = batch.seg_indptr.flip(0)
    _expect_error(lambda: shrink(x, layer.a, meta._replace(seg_indptr=bad_indptr)), "seg_indptr")


# --- the benchmark scripts stay runnable -------------------------------------------------------------


def test_gpu_benchmark_dry_run(capsys, load_bench):
    assert load_bench("gpu_ops").main(["--dry-run", "--hidden", "4096", "--ranks", "16"]) == 0
    printed = capsys.readouterr().out
    assert "12 cases" in printed and "tiny case under the Triton interpreter" in printed


def test_cpu_benchmark_agrees_with_its_baselines(capsys, load_bench):
    # Every case cross-checks lora_pin against PEFT's loop, gather-bmm, vLLM's and SGLang's paths first.
    argv = ["--hidden", "32", "--ranks", "4,8", "--decode-batch", "8", "--adapters", "3,8", "--threads", "1"]
    argv += ["--prefill-requests", "2", "--prefill-tokens", "20", "--rounds", "1", "--fixed-calls", "10"]
    assert load_bench("cpu_ops").main([*argv, "--flush-mb", "1", "--dtype", "fp32,bf16"]) == 0
    printed = capsys.readouterr().out
    assert "goal met in every case" in printed and "layer, no row uses the group" in printed


def test_cpu_benchmark_of_pages_agrees_with_the_reference(capsys, load_bench):
    # Each case checks the slot layout's ops and the paged ones against the fp64 reference first.
    argv = [
        "--layout",
        "pages",
        "--hidden",
        "32",
        "--ranks",
        "4,8,24",
        "--decode-batch",
        "8",
        "--threads",
        "1",
    ]
    argv += ["--adapters", "3,8", "--prefill-requests", "2", "--prefill-tokens", "40", "--rounds", "1"]
    argv += [
        "--fixed-calls",
        "0",
        "--flush-mb",
        "1",
        "--dtype",
        "fp32,bf16",
        "--page-rank",
        "8",
        "--stat",
        "min",
    ]
    assert load_bench("cpu_ops").main(argv) == 0
    printed = capsys.readouterr().out
    assert "page_rank 8 (min ms; ratio = slots / pages)" in printed and "goal met in every case" in printed


def test_the_documented_line_registers_the_ops_in_a_fresh_process() -> None:
    """README: ``import lora_pin.ops`` registers ``torch.ops.lora_pin.*``; ``import lora_pin`` alone does not
    import torch (nor, so, register them)."""
    import subprocess
    import sys

    probe = (
        "import sys, lora_pin; assert 'torch' not in sys.modules, 'import lora_pin pulled torch in'\n"
        "import torch, lora_pin.ops\n"
        "x = torch.randn(3, 8); a = torch.zeros(2, 4, 8)\n"
        "seg = lora_pin.ops.segments_from_slots(torch.tensor([0, -1, 1]))\n"
        "v = torch.ops.lora_pin.shrink(x, a, seg.perm, seg.seg_indptr, seg.seg_slots,"
        " torch.full((2, 1), 4, dtype=torch.int32), 1)\n"
        "print(tuple(v.shape))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(3, 4)"
