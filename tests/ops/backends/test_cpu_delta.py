"""The CPU backend's per-step LoRA delta (``CpuDelta``, what ``lora_pin::lora_delta_`` computes, planned
once per step and group) and the layer path that uses it: correctness against the fp64 reference,
opcheck of the fused op, one kernel state per step, no work for an unused group, results independent
of the thread count. Every test runs with the native kernels and with the torch path alone."""

from __future__ import annotations

import types

import pytest
import torch

from lora_pin._testing import PATTERNS, random_layer, request_slots
from lora_pin.model.layers import LoRALinear
from lora_pin.model.segments import StepSegments
from lora_pin.ops import OpArgumentError, lora_delta_, lora_reference, segments_from_slots
from lora_pin.ops.backends import CpuBackend
from lora_pin.ops.backends.cpu import CpuDelta

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


pytestmark = pytest.mark.usefixtures("cpu_path")  # native kernels, then the torch path (conftest.py)


def _case(pattern, tokens_per_request, dtype, seed=0, n_requests=12, hidden=48, widths=(64, 16, 16)):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(10, hidden, list(widths), [8, (4, 0, 8)], dtype, gen)
    slots = request_slots(pattern, n_requests, 10, gen, base_fraction=0.25)
    token_slots = torch.repeat_interleave(slots, tokens_per_request)
    x = torch.randn(token_slots.shape[0], hidden, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen).to(dtype)
    return layer, token_slots, x, out


def _reference(layer, token_slots, x, out):
    return lora_reference(out, x, layer.a, layer.b, token_slots, *layer[2:])


def _assert_close(got, want):
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 19], ids=["decode", "prefill"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_prepared_delta_matches_the_fp64_reference(pattern, tokens, dtype):
    layer, token_slots, x, out = _case(pattern, tokens, dtype)
    delta = CpuDelta.prepare(layer.meta(segments_from_slots(token_slots, 4)), layer.a, layer.b, x.shape[0])
    got = out.clone()
    with torch.inference_mode():
        delta.apply(got, x)
        delta.apply(again := out.clone(), x)  # a second call of the step reuses the plan
    _assert_close(got, _reference(layer, token_slots, x, out))
    assert torch.equal(again, got)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])  # rows with no adapter are untouched, bit for bit


@pytest.mark.parametrize("threads", [2, 3])
def test_results_do_not_depend_on_the_thread_count(threads, cpu_path):
    # Big enough for the kernels to cut one busy slot's work into tiles on several threads.
    layer, token_slots, x, out = _case("identical", 1, torch.float32, n_requests=64, hidden=512)
    meta = layer.meta(segments_from_slots(token_slots, 16))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lora_delta_(out.clone(), x, layer.a, layer.b, meta)
        torch.set_num_threads(threads)
        many = lora_delta_(out.clone(), x, layer.a, layer.b, meta)
    finally:
        torch.set_num_threads(previous)
    if cpu_path == "native":  # the kernels' tiles change who computes an output, not how (BLAS may differ)
        assert torch.equal(one, many)
    _assert_close(many, _reference(layer, token_slots, x, out))


def test_the_fused_op_passes_opcheck():
    layer, token_slots, x, out = _case("uniform", 3, torch.float32)
    meta = layer.meta(segments_from_slots(token_slots, 4))
    args = (out, x, layer.a, layer.b, *meta[:4], meta.slot_scalings, list(meta.slice_offsets))
    torch.library.opcheck(torch.ops.lora_pin.lora_delta_.default, args)


def test_each_step_gets_its_own_kernel_state():
    layer, first_slots, x, out = _case("distinct", 1, torch.float32)
    backend = CpuBackend()
    steps = [
        StepSegments(segments=segments_from_slots(slots), any_adapter=True)
        for slots in (first_slots, torch.flip(first_slots, [0]))
    ]
    active = [steps[0]]
    module = _layer(
        layer, layer.slot_ranks, first_slots, out.clone(), backend=backend, active=lambda: active[0]
    )
    with torch.inference_mode():
        first = module(x)
        kernels = backend.kernels(steps[0])
        assert backend.kernels(steps[0]) is kernels  # kept for the step's other layers
        active[0] = steps[1]  # the next step: its own arrays, planned anew
        module.base_layer.out = out.clone()
        second = module(x)
    assert backend.kernels(steps[1]) is not kernels
    _assert_close(first, _reference(layer, first_slots, x, out))
    _assert_close(second, _reference(layer, torch.flip(first_slots, [0]), x, out))


def test_apply_refuses_inputs_it_was_not_prepared_for():
    layer, token_slots, x, out = _case("zipf", 1, torch.float32)
    delta = CpuDelta.prepare(layer.meta(segments_from_slots(token_slots)), layer.a, layer.b, x.shape[0])
    with pytest.raises(OpArgumentError, match=r"prepared for x torch\.float32"):
        delta.apply(out[:-1].clone(), x[:-1])
    with pytest.raises(OpArgumentError, match=r"got x torch\.bfloat16"):
        delta.apply(out.clone(), x.bfloat16())


def test_prepare_refuses_bad_segments_by_name():
    layer, token_slots, x, _ = _case("uniform", 1, torch.float32)
    meta = layer.meta(segments_from_slots(token_slots))
    bad = meta._replace(perm=meta.perm.clone().fill_(x.shape[0]))
    with pytest.raises(OpArgumentError, match="perm holds tokens outside"):
        CpuDelta.prepare(bad, layer.a, layer.b, x.shape[0])


class _Output(torch.nn.Module):
    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


def _layer(layer, ranks, token_slots, out, backend=None, active=None):
    buffers = types.SimpleNamespace(
        group=types.SimpleNamespace(n_slices=3, key="qkv"),
        a=layer.a,
        b=layer.b,
        ranks=ranks,
        scalings=layer.slot_scalings,
        slice_offsets=layer.slice_offsets,
        dora_slots=None,
        page_rank=None,
    )
    step = StepSegments(segments=segments_from_slots(token_slots), any_adapter=True)
    return LoRALinear(_Output(out), buffers, active or (lambda: step), backend=backend)


def test_a_layer_runs_its_plan_without_an_op_call_and_nothing_for_a_group_no_row_uses(op_calls):
    layer, _, x, out = _case("uniform", 1, torch.float32)
    # Slots 1 and 2 have no rank in this group (their adapters target other modules).
    ranks = layer.slot_ranks.clone()
    ranks[1:3] = 0
    token_slots = torch.tensor([1, -1, 2, 1] * 3)
    module = _layer(layer, ranks, token_slots, out.clone())
    with torch.inference_mode(), op_calls() as calls:
        module(x)  # the first call of the step prepares (and may run ops to check the arrays)
        calls.names.clear()
        result = module(x)
    assert calls.names == []
    assert torch.equal(result, out)
    # The same layer with a row on a slot the group has: the delta, by the plan of the step's first call
    # (no lora_pin op: the backend runs the kernels itself).
    token_slots = torch.tensor([1, -1, 0, 1] * 3)
    got = out.clone()
    module = _layer(layer, ranks, token_slots, got)
    with torch.inference_mode(), op_calls() as calls:
        module(x)
    assert not [name for name in calls.names if name.startswith("lora_pin")]
    _assert_close(got, _reference(layer._replace(slot_ranks=ranks), token_slots, x, out))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_runs_of_one_slot_match_the_reference(dtype, threads):
    # Long runs of one slot, one of a slot with a rank-0 slice, beside base rows; on one thread their
    # shrink runs in the native kernels in fp32 (where the CPU has them), otherwise on BLAS.
    gen = torch.Generator().manual_seed(5)
    layer = random_layer(3, 40, [64, 16, 16], [8, (4, 0, 8)], dtype, gen)
    token_slots = torch.tensor([1] * 300 + [-1] * 7 + [0] * 200 + [2] * 129)
    x = torch.randn(token_slots.shape[0], 40, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], 96, generator=gen).to(dtype)
    delta = CpuDelta.prepare(layer.meta(segments_from_slots(token_slots, 64)), layer.a, layer.b, x.shape[0])
    got = out.clone()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            delta.apply(got, x)
    finally:
        torch.set_num_threads(previous)
    _assert_close(got, _reference(layer, token_slots, x, out))
    assert torch.equal(got[300:307], out[300:307])


def test_groups_of_one_shape_share_a_plan_only_when_their_ranks_agree():
    layer, token_slots, x, out = _case("uniform", 1, torch.float32)
    segments = segments_from_slots(token_slots)
    first = CpuDelta.prepare(layer.meta(segments), layer.a, layer.b, x.shape[0])
    # Another group of the same shapes and ranks (other weights): the plan is shared, the result its own.
    other_a, other_b = layer.a.flip(0).contiguous(), layer.b.flip(0).contiguous()
    same = CpuDelta.prepare(layer.meta(segments), other_a, other_b, x.shape[0], like=first)
    assert same.plan is first.plan
    got = out.clone()
    with torch.inference_mode():
        same.apply(got, x)
    _assert_close(got, lora_reference(out, x, other_a, other_b, token_slots, *layer[2:]))
    # A group whose adapters have no rank in it: planned on its own (empty), not given the first's plan.
    ranks = torch.zeros_like(layer.slot_ranks)
    unused = CpuDelta.prepare(
        layer.meta(segments)._replace(slot_ranks=ranks), layer.a, layer.b, x.shape[0], like=first
    )
    assert unused.plan is not first.plan and unused.empty and not first.empty
