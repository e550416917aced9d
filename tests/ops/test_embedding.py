"""The embedding's LoRA delta (``lora_pin::embedding_delta_``, and the CPU backend's per-step
``CpuEmbeddingDelta``) and the CPU path of ``LoRAEmbedding`` that uses it: against an fp64 reference of
PEFT's embedding formula, opcheck, refusals, and no work for a group no row of the step uses. Every test
runs with the native kernels and with the torch path alone. The layer against PEFT itself:
tests/model/test_embedding_lm_head.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lora_pin._testing import PATTERNS, random_layer, request_slots
from lora_pin.model.layers import LoRAEmbedding
from lora_pin.model.segments import StepSegments
from lora_pin.ops import KernelMeta, OpArgumentError, segments_from_slots
from lora_pin.ops.backends.cpu import CpuEmbeddingDelta
from lora_pin.ops.embedding import embedding_delta_

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
VOCAB, DIM = 50, 40


pytestmark = pytest.mark.usefixtures("cpu_path")  # native kernels, then the torch path (conftest.py)


def _case(pattern, tokens_per_request, dtype, seed=0, n_requests=12):
    """An embedding group of 10 slots (ranks 8, 4 and 0: an adapter without weights on the embedding),
    a step's token slots (a quarter base rows), ids and base embeddings."""
    gen = torch.Generator().manual_seed(seed)
    # A linear [VOCAB -> DIM]'s A is [slots, R, VOCAB], an embedding's A is laid out alike.
    layer = random_layer(10, VOCAB, [DIM], [8, 4, 0], dtype, gen)
    slots = request_slots(pattern, n_requests, 10, gen, base_fraction=0.25)
    token_slots = torch.repeat_interleave(slots, tokens_per_request)
    ids = torch.randint(0, VOCAB, token_slots.shape, generator=gen)
    out = torch.randn(token_slots.shape[0], DIM, generator=gen).to(dtype)
    return layer, token_slots, ids, out


def _reference(layer, token_slots, ids, out, scale):
    """PEFT's embedding delta in fp64: ``out[t] += scaling * scale * B[:, :r] @ A[:r, id]``."""
    want = out.double()
    for t, slot in enumerate(token_slots.tolist()):
        rank = int(layer.slot_ranks[slot, 0]) if slot >= 0 else 0
        if rank:
            column = layer.a[slot, :rank, int(ids[t])].double() * scale
            want[t] += float(layer.slot_scalings[slot, 0]) * (layer.b[slot, :, :rank].double() @ column)
    return want


def _assert_close(got, want):
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 19], ids=["decode", "prefill"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_prepared_delta_and_the_op_match_the_fp64_reference(pattern, tokens, dtype):
    layer, token_slots, ids, out = _case(pattern, tokens, dtype)
    meta = layer.meta(segments_from_slots(token_slots, 4))
    scale = 2.5 if tokens == 1 else 1.0
    delta = CpuEmbeddingDelta.prepare(meta, layer.a, layer.b, ids.shape[0], scale)
    want = _reference(layer, token_slots, ids, out, scale)
    with torch.inference_mode():
        delta.apply(got := out.clone(), ids)
        delta.apply(again := out.clone(), ids)  # a second call of the step reuses the plan
        direct = embedding_delta_(out.clone(), ids, layer.a, layer.b, meta, scale)  # checked in full
    _assert_close(got, want)
    assert torch.equal(again, got)
    assert torch.equal(direct, got)
    # Rows with no adapter, or with one that has no weights here, are untouched bit for bit.
    untouched = (token_slots < 0) | (layer.slot_ranks[token_slots.clamp_min(0), 0] == 0)
    assert torch.equal(got[untouched], out[untouched])


def test_the_op_passes_opcheck():
    layer, token_slots, ids, out = _case("zipf", 3, torch.float32)
    meta = layer.meta(segments_from_slots(token_slots, 4))
    torch.library.opcheck(
        torch.ops.lora_pin.embedding_delta_.default,
        (out.clone(), ids, layer.a, layer.b, *meta[:4], meta.slot_scalings, [0, DIM], 1.5),
    )


def test_bad_arguments_are_refused_by_name_and_change_nothing():
    layer, token_slots, ids, out = _case("distinct", 1, torch.float32)
    meta = layer.meta(segments_from_slots(token_slots))
    bad_ids = ids.clone()
    bad_ids[int((token_slots >= 0).nonzero()[0])] = VOCAB  # an adapter row's id past the vocabulary
    cases = [
        ((out, bad_ids, layer.a, layer.b, meta), "ids holds"),
        ((out, ids.int(), layer.a, layer.b, meta), "ids must be int64"),
        ((out, ids[:-1], layer.a, layer.b, meta), "ids must be int64"),
        ((out, ids, layer.a[:, :4], layer.b, meta), "a has rank 4"),
        ((out, ids, layer.a.double(), layer.b, meta), "a must be torch.float32"),
        ((out, ids, layer.a, layer.b, meta._replace(slice_offsets=(0, 20, DIM), n_slices=2)), "one slice"),
    ]
    for args, message in cases:
        before = out.clone()
        with torch.inference_mode(), pytest.raises(OpArgumentError, match=message):
            embedding_delta_(*args)
        assert torch.equal(out, before)
    delta = CpuEmbeddingDelta.prepare(meta, layer.a, layer.b, ids.shape[0])
    with torch.inference_mode(), pytest.raises(OpArgumentError, match="prepared for ids int64"):
        delta.apply(out, ids[:-1])


class _Calls(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _embedding(layer, ranks, token_slots):
    base = torch.nn.Embedding(VOCAB, DIM)
    buffers = types.SimpleNamespace(
        group=types.SimpleNamespace(n_slices=1, key="embed_tokens"),
        a=layer.a,
        b=layer.b,
        ranks=ranks,
        scalings=layer.slot_scalings,
        slice_offsets=layer.slice_offsets,
        dora_slots=None,
    )
    step = StepSegments(segments=segments_from_slots(token_slots), any_adapter=True)
    return base, LoRAEmbedding(base, buffers, lambda: step)  # type: ignore[arg-type]


def test_the_layer_runs_its_plan_without_an_op_call_and_nothing_for_a_group_no_row_uses():
    layer, _, ids, _ = _case("uniform", 1, torch.float32)
    token_slots = torch.tensor([1, -1, 2, 1] * 3)
    ids = ids[: token_slots.shape[0]]
    ranks = layer.slot_ranks.clone()
    ranks[1:3] = 0  # slots 1 and 2: adapters without weights on the embedding
    base, module = _embedding(layer, ranks, token_slots)
    with torch.inference_mode(), _Calls() as calls:
        module(ids)  # the first call of the step prepares (and runs ops to read the arrays)
        calls.names.clear()
        got = module(ids)
    assert calls.names == ["aten.embedding.default"]  # the base embedding's, and nothing of the delta
    assert torch.equal(got, base(ids))
    # Rows on a slot the group has: PEFT's formula's result, by the plan made on the step's first call
    # (no lora_pin op: the backend runs the kernels itself).
    token_slots = torch.tensor([1, -1, 0, 1] * 3)
    base, module = _embedding(layer, ranks, token_slots)
    with torch.inference_mode(), _Calls() as calls:
        module(ids)
        calls.names.clear()
        got = module(ids)
    assert not [name for name in calls.names if name.startswith("lora_pin")]
    with torch.no_grad():
        want = _reference(layer._replace(slot_ranks=ranks), token_slots, ids, base(ids), 1.0)
    _assert_close(got, want)


def test_a_meta_made_for_shrink_alone_is_refused():
    layer, token_slots, ids, _ = _case("identical", 1, torch.float32)
    seg = segments_from_slots(token_slots)
    meta = KernelMeta(seg.perm, seg.seg_indptr, seg.seg_slots, layer.slot_ranks, 1)
    with pytest.raises(OpArgumentError, match="slot_scalings and slice_offsets"):
        CpuEmbeddingDelta.prepare(meta, layer.a, layer.b, ids.shape[0])
