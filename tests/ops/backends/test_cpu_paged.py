"""The CPU backend on a paged pool (``ops/backends/cpu_paged.py``): each layer group's paged shrink and
expand checked and planned on its first call of the step (one plan lookup), later calls and groups of
the same ranks run by that plan, a new step with other page tables planned anew; every result against
the fp64 reference. Every test runs with the native kernels and with the torch path alone."""

from __future__ import annotations

import types

import pytest
import torch

from lora_pin._testing import random_layer, request_slots
from lora_pin.model.layers import LoRALinear
from lora_pin.model.segments import StepSegments
from lora_pin.ops import OpArgumentError, lora_reference, segments_from_slots
from lora_pin.ops.backends import CpuBackend, cpu_paged
from lora_pin.ops.paged import pages_from_slots

pytestmark = pytest.mark.usefixtures(
    "cpu_path"
)  # native kernels, then the torch path (tests/ops/conftest.py)

PAGE_RANK, HIDDEN, WIDTHS = 8, 48, [40, 16, 16]
# Mixed ranks over 9 slots, one idle (0) and one with a rank per slice.
RANKS = [4, 8, 16, 24, 0, (16, 0, 12), 5, 8, 12]


class _Output(torch.nn.Module):
    """A base layer that returns a copy of ``out`` (the LoRA delta is added into what it returns)."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out.clone()


def _case(seed: int, tokens_per_request: int = 1):
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(len(RANKS), HIDDEN, WIDTHS, RANKS, torch.float32, gen)
    slots = request_slots("uniform", 14, len(RANKS), gen, base_fraction=0.2)
    token_slots = torch.repeat_interleave(slots, tokens_per_request)
    x = torch.randn(token_slots.shape[0], HIDDEN, generator=gen)
    out = torch.randn(token_slots.shape[0], layer.slice_offsets[-1], generator=gen)
    return layer, token_slots, x, out, gen


def _buffers(layer, a_pages, b_pages, ranks=None):
    return types.SimpleNamespace(
        group=types.SimpleNamespace(n_slices=len(WIDTHS), key="qkv"),
        a=a_pages,
        b=b_pages,
        ranks=layer.slot_ranks if ranks is None else ranks,
        scalings=layer.slot_scalings,
        slice_offsets=layer.slice_offsets,
        dora_slots=None,
        page_rank=PAGE_RANK,
        max_rank=layer.a.shape[1] // len(WIDTHS),
    )


def _reference(layer, token_slots, x, out):
    return lora_reference(out, x, layer.a, layer.b, token_slots, *layer[2:]).double()


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of ``cpu_paged``'s ``name`` (``plan_for``: the step's plan lookups, each hashing the
    step's arrays; ``delta_planned``: the fused native calls). The real function runs: the count is all
    that is added."""
    calls = [0]
    real = getattr(cpu_paged, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_paged, name, counted)
    return calls


def test_a_steps_later_calls_and_groups_of_the_same_ranks_reuse_the_first_plan(monkeypatch, op_calls):
    layer, token_slots, x, out, gen = _case(1)
    a_pages, b_pages, pages = pages_from_slots(layer.a, layer.b, layer.slot_ranks, PAGE_RANK, generator=gen)
    step = StepSegments(segments=segments_from_slots(token_slots, 3), pages=pages)
    backend = CpuBackend()
    first = _buffers(layer, a_pages, b_pages)
    # Another layer's group: other weights in pages of the same shapes, the same ranks.
    other_layer = layer._replace(a=layer.a.flip(0).contiguous(), b=layer.b.flip(0).contiguous())
    # Laid out in the same pages as the first's: a step has one set of page tables for all its groups.
    other_a, other_b = _paged_like(other_layer, pages, a_pages.shape[0])
    second = _buffers(other_layer, other_a, other_b)
    layers = [LoRALinear(_Output(out), buffers, lambda: step, backend=backend) for buffers in (first, second)]
    looked_up = _count_calls(monkeypatch, "plan_for")
    with torch.inference_mode():
        got = layers[0](x)
        assert looked_up[0] == 1
        with op_calls() as calls:
            again = layers[0](x)
        got_second = layers[1](x)
    assert looked_up[0] == 1, "the step's later call and the group of the same ranks must not look a plan up"
    assert not [name for name in calls.names if name.startswith("lora_pin")], calls.names
    kernels = backend.kernels(step)
    offsets = list(layer.slice_offsets)
    work = kernels.paged(first, x, offsets, None)
    assert kernels.paged(first, x, offsets, None) is work
    assert kernels.paged(second, x, offsets, None).shrink_work.plan is work.shrink_work.plan
    torch.testing.assert_close(got.double(), _reference(layer, token_slots, x, out), atol=1e-4, rtol=1e-4)
    assert torch.equal(again, got)
    want_second = _reference(other_layer, token_slots, x, out)
    torch.testing.assert_close(got_second.double(), want_second, atol=1e-4, rtol=1e-4)
    # A group whose adapters have no rank in it: its own plan (empty), the output untouched.
    unused = _buffers(layer, a_pages.clone(), b_pages.clone(), ranks=torch.zeros_like(layer.slot_ranks))
    with torch.inference_mode():
        untouched = LoRALinear(_Output(out), unused, lambda: step, backend=backend)(x)
    assert looked_up[0] == 2 and kernels.paged(unused, x, offsets, None).empty
    assert torch.equal(untouched, out)


def _paged_like(layer, pages, num_pages):
    """``layer``'s adapters copied into the pages ``pages`` gives each slot (``num_pages`` in all, the
    rest NaN): what a pool holds after its loads into the pages the core chose."""
    n_slices = len(WIDTHS)
    max_rank = layer.a.shape[1] // n_slices
    a_pages = layer.a.new_full((num_pages, n_slices * PAGE_RANK, HIDDEN), float("nan"))
    b_pages = layer.b.new_full((num_pages, layer.b.shape[1], PAGE_RANK), float("nan"))
    indptr, table = pages.page_indptr.tolist(), pages.page_table.tolist()
    for slot in range(len(indptr) - 1):
        for j, page in enumerate(table[indptr[slot] : indptr[slot + 1]]):
            a_pages[page].zero_()
            b_pages[page].zero_()
            lo, hi = j * PAGE_RANK, min((j + 1) * PAGE_RANK, max_rank)
            for s in range(n_slices):
                top = min(hi, int(layer.slot_ranks[slot, s]))
                if top > lo:
                    rows = layer.a[slot, s * max_rank + lo : s * max_rank + top]
                    a_pages[page, s * PAGE_RANK : s * PAGE_RANK + top - lo] = rows
            b_pages[page, :, : hi - lo] = layer.b[slot, :, lo:hi]
    return a_pages, b_pages


def test_a_new_step_reads_the_adapters_from_the_pages_its_tables_give():
    """The adapters moved into other pages of the same pool between two steps with the same segments
    (the same tensors) and ranks: the second step plans anew and reads the new pages."""
    layer, token_slots, x, out, gen = _case(2)
    segments = segments_from_slots(token_slots, 3)
    a_pages, b_pages, first_pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, PAGE_RANK, spare_pages=3, generator=gen
    )
    moved_a, moved_b, moved_pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, PAGE_RANK, spare_pages=3, generator=gen
    )
    assert not torch.equal(moved_pages.page_table, first_pages.page_table)
    backend = CpuBackend()
    steps = [
        StepSegments(segments=segments, pages=first_pages),
        StepSegments(segments=segments, pages=moved_pages),
    ]
    active = [steps[0]]
    module = LoRALinear(_Output(out), _buffers(layer, a_pages, b_pages), lambda: active[0], backend=backend)
    want = _reference(layer, token_slots, x, out)
    with torch.inference_mode():
        first = module(x)
        first_kernels = backend.kernels(steps[0])
        # The pool's buffers are rewritten in place, as the loads of the next step write them.
        a_pages.copy_(moved_a)
        b_pages.copy_(moved_b)
        active[0] = steps[1]
        second = module(x)
    assert backend.kernels(steps[1]) is not first_kernels
    torch.testing.assert_close(first.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second.double(), want, atol=1e-4, rtol=1e-4)


def test_bad_page_tables_are_refused_by_name_on_the_first_call_and_inputs_on_every_call():
    layer, token_slots, x, out, gen = _case(3)
    a_pages, b_pages, pages = pages_from_slots(layer.a, layer.b, layer.slot_ranks, PAGE_RANK, generator=gen)
    segments = segments_from_slots(token_slots, 3)
    outside = pages.page_table.clone()
    outside[-1] = a_pages.shape[0]
    bad = StepSegments(segments=segments, pages=pages._replace(page_table=outside))
    module = LoRALinear(_Output(out), _buffers(layer, a_pages, b_pages), lambda: bad, backend=CpuBackend())
    with torch.inference_mode(), pytest.raises(OpArgumentError, match="page_table holds pages outside"):
        module(x)
    other_rank = StepSegments(segments=segments, pages=pages._replace(page_rank=4))
    module = LoRALinear(
        _Output(out), _buffers(layer, a_pages, b_pages), lambda: other_rank, backend=CpuBackend()
    )
    with torch.inference_mode(), pytest.raises(OpArgumentError, match="page tables of page_rank=4"):
        module(x)
    step = StepSegments(segments=segments, pages=pages)
    kernels = CpuBackend().kernels(step)
    work = kernels.paged(_buffers(layer, a_pages, b_pages), x, list(layer.slice_offsets), None)
    with pytest.raises(OpArgumentError, match=r"paged LoRA shrink was prepared for x torch\.float32"):
        work.shrink(x[:-1])
    v = work.shrink(x)
    got = out.clone()
    with pytest.raises(OpArgumentError, match="out overlaps v"):
        work.expand(v.view(-1)[: out.numel()].view(out.shape), v)
    with pytest.raises(OpArgumentError, match=r"paged LoRA expand was prepared for out"):
        work.expand(got.bfloat16(), v.bfloat16())
    assert torch.equal(got, out), "a refused call must leave out as it was"


def _paged_work(layer, token_slots, x, gen):
    """``layer``'s adapters in shuffled pages, and the CPU backend's prepared work of one step over them
    for ``x``: ``(b_pages, work)``."""
    a_pages, b_pages, pages = pages_from_slots(layer.a, layer.b, layer.slot_ranks, PAGE_RANK, generator=gen)
    step = StepSegments(segments=segments_from_slots(token_slots, 3), pages=pages)
    kernels = CpuBackend().kernels(step)
    work = kernels.paged(_buffers(layer, a_pages, b_pages), x, list(layer.slice_offsets), None)
    return b_pages, work


@pytest.mark.parametrize("tokens_per_request", [1, 80])
def test_a_decode_step_runs_shrink_and_expand_in_one_native_call(monkeypatch, cpu_path, tokens_per_request):
    """Decode (a few tokens a slot): one native call a group, equal bit for bit to the shrink then the
    expand (v rounds the same in the kernels' scratch); a prefill whose slots' shrinks are cut in groups
    runs the two ops apart. Either way the fp64 reference holds, and a refused call writes nothing."""
    layer, token_slots, x, out, gen = _case(4, tokens_per_request)
    work = _paged_work(layer, token_slots, x, gen)[1]
    fused = cpu_path == "native" and tokens_per_request == 1
    assert work.shrink_work.plan.fused is fused or cpu_path == "torch"
    calls = _count_calls(monkeypatch, "delta_planned")
    with torch.inference_mode():
        got = out.clone()
        work.apply(got, x)
        apart = out.clone()
        work.expand(apart, work.shrink(x))
    assert calls[0] == int(fused)
    assert torch.equal(got, apart)
    want = _reference(layer, token_slots, x, out)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(OpArgumentError, match=r"paged LoRA expand was prepared for out torch\.float32"):
        work.apply(got[:-1], x)
    with pytest.raises(OpArgumentError, match=r"paged LoRA shrink was prepared for x"):
        work.apply(got, x[:, :-1])
    assert torch.equal(got, apart), "a refused call writes nothing"


def test_a_fused_call_refuses_an_out_that_overlaps_what_it_reads(cpu_path):
    layer, token_slots, x, out, gen = _case(5)
    b_pages, work = _paged_work(layer, token_slots, x, gen)
    overlapping = b_pages.view(-1)[: out.numel()].view(out.shape)
    before = b_pages.clone()
    with torch.inference_mode(), pytest.raises(OpArgumentError, match="out overlaps b_pages"):
        work.apply(overlapping, x)
    assert torch.equal(b_pages, before), "a refused call writes nothing"
