"""The expert LoRA op (``lora_pin.ops.experts``) against its float64 per-row reference.

Routed rows are drawn like a MoE layer's: each request's tokens carry its adapter's slot (or none),
each token ``k`` experts; the segments group the rows by (slot, expert). The CPU path runs the registered
ops; the Triton kernels run under the interpreter on tiny shapes (fp32 and fp16), as in
``test_triton_sgmv.py``.
"""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import PATTERNS, request_slots
from lora_pin.errors import OpArgumentError
from lora_pin.ops import (
    ExpertMeta,
    expert_lora_delta_,
    expert_reference,
    expert_segments,
    flat_expert_buffers,
)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3}
SLOTS, EXPERTS, TOP_K, HIDDEN, OUT = 4, 5, 2, 24, 20


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _pool(
    dtype: torch.dtype, gen: torch.Generator, ranks: list[int], max_rank: int = 8
) -> tuple[torch.Tensor, ...]:
    """An experts group's pool buffers with each slot's weights at its rank and zero past it."""
    a = torch.zeros(SLOTS, EXPERTS * max_rank, HIDDEN)
    b = torch.zeros(SLOTS, EXPERTS * OUT, max_rank)
    for slot, rank in enumerate(ranks):
        a[slot].view(EXPERTS, max_rank, HIDDEN)[:, :rank] = torch.randn(EXPERTS, rank, HIDDEN, generator=gen)
        b[slot][:, :rank] = torch.randn(EXPERTS * OUT, rank, generator=gen)
    slot_ranks = torch.tensor(ranks, dtype=torch.int32).unsqueeze(1).repeat(1, EXPERTS)
    scalings = (torch.rand(SLOTS, 1, generator=gen) + 0.5).repeat(1, EXPERTS)
    return a.to(dtype), b.to(dtype), slot_ranks, scalings


def _rows(pattern: str, dtype: torch.dtype, gen: torch.Generator, n_requests: int = 8, tokens: int = 3):
    slots = request_slots(pattern, n_requests, SLOTS, gen, base_fraction=0.25)
    token_slots = torch.repeat_interleave(slots, tokens)
    row_slots = token_slots.repeat_interleave(TOP_K)
    row_experts = torch.randint(0, EXPERTS, (row_slots.shape[0],), generator=gen)
    x = torch.randn(row_slots.shape[0], HIDDEN, generator=gen).to(dtype)
    out = torch.randn(row_slots.shape[0], OUT, generator=gen).to(dtype)
    return row_slots, row_experts, x, out


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_the_cpu_path_matches_the_per_row_reference(pattern: str, chunk_size: int | None) -> None:
    gen = torch.Generator().manual_seed(PATTERNS.index(pattern))
    a, b, ranks, scalings = _pool(torch.float32, gen, [2, 8, 5, 1])
    row_slots, row_experts, x, out = _rows(pattern, torch.float32, gen)
    segments = expert_segments(row_slots, row_experts, EXPERTS, chunk_size)
    got = expert_lora_delta_(out.clone(), x, a, b, ExpertMeta.for_group(segments, ranks, scalings, OUT))
    want = expert_reference(out, x, a, b, row_slots, row_experts, ranks, scalings)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base = row_slots < 0
    assert base.any() and torch.equal(_bits(got[base]), _bits(out[base])), "base rows must be untouched"


def test_segments_group_rows_by_slot_then_expert_and_skip_foreign_experts() -> None:
    row_slots = torch.tensor([1, 0, -1, 1, 0, 1])
    row_experts = torch.tensor([2, 4, 1, 0, 4, EXPERTS])  # the last: an expert this rank does not hold
    perm, seg_indptr, seg_slots = expert_segments(row_slots, row_experts, EXPERTS)[:3]
    assert perm.tolist() == [1, 4, 3, 0]
    assert seg_indptr.tolist() == [0, 2, 3, 4]
    assert seg_slots.tolist() == [0 * EXPERTS + 4, 1 * EXPERTS + 0, 1 * EXPERTS + 2]


def test_an_expert_past_its_slots_rank_reads_nothing() -> None:
    """Weights past a slot's rank (NaN here) are never read, for every expert."""
    gen = torch.Generator().manual_seed(3)
    a, b, ranks, scalings = _pool(torch.float32, gen, [2, 3, 3, 3])
    a[0].view(EXPERTS, -1, HIDDEN)[:, 2:] = float("nan")
    b[0][:, 2:] = float("nan")
    row_slots, row_experts, x, out = _rows("identical", torch.float32, gen)
    row_slots = torch.where(row_slots >= 0, 0, -1)
    segments = expert_segments(row_slots, row_experts, EXPERTS)
    got = expert_lora_delta_(out.clone(), x, a, b, ExpertMeta.for_group(segments, ranks, scalings, OUT))
    assert torch.isfinite(got).all()


def test_bad_arguments_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, _, _ = _pool(torch.float32, gen, [1, 1, 1, 1])
    with pytest.raises(OpArgumentError, match="differ in length"):
        expert_segments(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), EXPERTS)
    with pytest.raises(OpArgumentError, match="row_experts must be a 1-D integer"):
        expert_segments(torch.zeros(3, dtype=torch.long), torch.zeros(3), EXPERTS)
    with pytest.raises(OpArgumentError, match="do not hold 3 experts"):
        flat_expert_buffers(a, b, 3)


def test_opcheck_on_the_ops_over_expert_segments() -> None:
    gen = torch.Generator().manual_seed(5)
    a, b, ranks, scalings = _pool(torch.float32, gen, [4, 2, 8, 1])
    row_slots, row_experts, x, out = _rows("zipf", torch.float32, gen)
    meta = ExpertMeta.for_group(expert_segments(row_slots, row_experts, EXPERTS), ranks, scalings, OUT)
    a_flat, b_flat = flat_expert_buffers(a, b, EXPERTS)
    k = meta.kernel
    v = torch.ops.lora_pin.shrink(x, a_flat, k.perm, k.seg_indptr, k.seg_slots, k.slot_ranks, 1)
    torch.library.opcheck(
        torch.ops.lora_pin.shrink.default, (x, a_flat, k.perm, k.seg_indptr, k.seg_slots, k.slot_ranks, 1)
    )
    torch.library.opcheck(
        torch.ops.lora_pin.expand.default,
        (out.clone(), v, b_flat, k.perm, k.seg_indptr, k.seg_slots, k.slot_ranks, k.slot_scalings, [0, OUT]),
    )


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("pattern", ["distinct", "skewed"])
def test_the_triton_kernels_match_the_reference_under_the_interpreter(
    pattern: str, dtype: torch.dtype
) -> None:
    triton_sgmv = pytest.importorskip("lora_pin.ops.triton_sgmv")
    gen = torch.Generator().manual_seed(7 + PATTERNS.index(pattern))
    a, b, ranks, scalings = _pool(dtype, gen, [3, 8, 1, 6])
    row_slots, row_experts, x, out = _rows(pattern, dtype, gen, n_requests=6, tokens=2)
    meta = ExpertMeta.for_group(expert_segments(row_slots, row_experts, EXPERTS, 4), ranks, scalings, OUT)
    a_flat, b_flat = flat_expert_buffers(a, b, EXPERTS)
    v = triton_sgmv.sgmv_shrink(x, a_flat, meta.kernel, interpret=True)
    got = out.clone()
    triton_sgmv.sgmv_expand(got, v, b_flat, meta.kernel, interpret=True)
    want = expert_reference(out, x, a, b, row_slots, row_experts, ranks, scalings)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)
    base = row_slots < 0
    assert torch.equal(_bits(got[base]), _bits(out[base])), "base rows must be untouched"


def test_the_benchmark_agrees_with_its_loop_baseline(capsys, load_bench) -> None:
    """benches/moe_experts.py checks the op against its per-(adapter, expert) loop before timing."""
    module = load_bench("moe_experts")
    argv = ["--hidden", "32", "--out", "16", "--rank", "4", "--slots", "3", "--experts", "4"]
    argv += ["--decode-batch", "8", "--prefill-requests", "2", "--prefill-tokens", "6", "--rounds", "1"]
    assert module.main(argv) == 0
    assert "geometric mean loop/lora_pin" in capsys.readouterr().out
