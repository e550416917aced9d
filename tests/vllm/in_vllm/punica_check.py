"""Run by tests/vllm/test_punica.py in the vLLM venv (no pytest there): lora_pin's punica wrapper against
an fp64 reference, on a mixed batch (base rows, three adapters of ranks 2, 4 and 8 in a pool of max rank
8, tokens interleaved), for every method vLLM's layers call, and for layers some or all adapters have no
weights for. Prints one JSON object:
``{"errors": {method: max abs error}, "base_rows_touched": {method: bool}, "vllm_base_rows_touched": ...}``
(the last: vLLM's own CPU wrapper on the same inputs, which gives base rows the last slot's adapter).
"""

from __future__ import annotations

import json

import torch
from vllm.lora.layers import LoRAMapping
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from lora_pin.vllm.punica import LoraPinPunicaWrapper

torch.manual_seed(0)
SLOTS, R, IN, VOCAB = 3, 8, 32, 40
SLICES = (24, 8, 8)  # fused q/k/v under GQA
RANKS = (2, 4, 8)  # per slot
IDS = (11, 12, 13)  # vLLM's adapter ids in slots 0..2
# Per token: adapter id (0: base). Base tokens sit between and after adapter tokens.
TOKENS = (0, 11, 11, 0, 13, 12, 0, 13, 13, 11, 0, 0)
T = len(TOKENS)


def stacked(
    out_sizes: tuple[int, ...], in_size: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """vLLM's buffers: A ``[slots, 1, R, in]``, B ``[slots, 1, out, R]`` per slice. vLLM zeroes a slot
    past its adapter's rank; here it holds large values instead, so that a wrapper multiplying more than
    each slot's rank (the padding up to --max-lora-rank) shows."""
    a_all, b_all = [], []
    for out in out_sizes:
        a = torch.full((SLOTS, 1, R, in_size), 1e3)
        b = torch.full((SLOTS, 1, out, R), 1e3)
        for slot, rank in enumerate(RANKS):
            a[slot, 0, :rank] = torch.randn(rank, in_size)
            b[slot, 0, :, :rank] = torch.randn(out, rank)
        a_all.append(a)
        b_all.append(b)
    return tuple(a_all), tuple(b_all)


def slot_of(token: int) -> int:
    return IDS.index(token) if token else -1


def reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: tuple[torch.Tensor, ...],
    b: tuple[torch.Tensor, ...],
    scale: float,
    rows: tuple[int, ...],
) -> torch.Tensor:
    """fp64 ``y + scale * x A^T B^T`` per row with an adapter, slice by slice."""
    out = y.double().clone()
    for t, token in enumerate(rows):
        if not token:
            continue
        slot, offset = slot_of(token), 0
        rank = RANKS[slot]
        for a_s, b_s in zip(a, b, strict=True):
            width = b_s.shape[2]
            a_t, b_t = a_s[slot, 0, :rank].double(), b_s[slot, 0, :, :rank].double()
            out[t, offset : offset + width] += scale * (b_t @ (a_t @ x[t].double()))
            offset += width
    return out


def wrapper(cls: type) -> PunicaWrapperCPU:
    w = cls(64, 16, "cpu")
    if isinstance(w, LoraPinPunicaWrapper):
        for slot, rank in enumerate(RANKS):
            w.set_slot(slot, SLOTS, rank)
    # One sampled row per "request": the last token of each run of tokens.
    w.update_metadata(LoRAMapping(TOKENS, TOKENS, is_prefill=True), list(IDS), SLOTS + 1, VOCAB)
    return w


def base_touched(got: torch.Tensor, y: torch.Tensor, rows: tuple[int, ...]) -> bool:
    base = [t for t, token in enumerate(rows) if not token]
    return not torch.equal(got[base], y[base])


result: dict[str, dict[str, object]] = {"errors": {}, "base_rows_touched": {}, "vllm_base_rows_touched": {}}
x = torch.randn(T, IN)
a, b = stacked(SLICES, IN)
a1, b1 = stacked((16,), IN)
for cls, key in ((LoraPinPunicaWrapper, "base_rows_touched"), (PunicaWrapperCPU, "vllm_base_rows_touched")):
    w = wrapper(cls)
    # add_lora_linear, fused (three slices) and plain.
    for name, (aa, bb) in {"linear_fused": (a, b), "linear": (a1, b1)}.items():
        y = torch.randn(T, sum(s.shape[2] for s in bb))
        got = y.clone()
        w.add_lora_linear(got, x, aa, bb, 0.5, tuple(s.shape[2] for s in bb))
        result[key][name] = base_touched(got, y, TOKENS)
        if key == "base_rows_touched":
            result["errors"][name] = float((got.double() - reference(y, x, aa, bb, 0.5, TOKENS)).abs().max())
    # A second step reusing the prepared plan must see the new step's rows (another mapping).
    if cls is LoraPinPunicaWrapper:
        swapped = tuple(IDS[(IDS.index(t) + 1) % 3] if t else 0 for t in TOKENS)
        w.update_metadata(LoRAMapping(swapped, swapped, is_prefill=True), list(IDS), SLOTS + 1, VOCAB)
        y = torch.randn(T, 40)
        got = y.clone()
        w.add_lora_linear(got, x, a, b, 1.0, SLICES)
        result["errors"]["linear_next_step"] = float(
            (got.double() - reference(y, x, a, b, 1.0, swapped)).abs().max()
        )
        w = wrapper(cls)
    # add_shrink then add_expand (fully sharded layers).
    y = torch.randn(T, 40)
    got = y.clone()
    buffers = tuple(torch.zeros(T, R) for _ in SLICES)
    w.add_shrink(buffers, x, a, 0.5)
    w.add_expand(got, buffers, b, SLICES, offset_start=0, add_inputs=True)
    result[key]["shrink_expand"] = base_touched(got, y, TOKENS)
    if key == "base_rows_touched":
        result["errors"]["shrink_expand"] = float(
            (got.double() - reference(y, x, a, b, 0.5, TOKENS)).abs().max()
        )
    # add_lora_embedding: x is each token's row of A (the lookup vLLM's layer does).
    emb_b = b1[0]
    v = torch.randn(T, R)
    for t, token in enumerate(TOKENS):
        if token:
            v[t, RANKS[slot_of(token)] :] = 1e3
    y = torch.randn(T, 16)
    got = y.clone()
    w.add_lora_embedding(got, v, emb_b, add_inputs=True)
    result[key]["embedding"] = base_touched(got, y, TOKENS)
    if key == "base_rows_touched":
        want = y.double().clone()
        for t, token in enumerate(TOKENS):
            if token:
                rank = RANKS[slot_of(token)]
                want[t] += emb_b[slot_of(token), 0, :, :rank].double() @ v[t, :rank].double()
        result["errors"]["embedding"] = float((got.double() - want).abs().max())
    # add_lora_logits over padded logits (vocab 16 in a row of 20).
    la, lb = stacked((16,), IN)
    y = torch.randn(T, 20)
    got = y.clone()
    w.add_lora_logits(got, x, la[0], lb[0], 0.5)
    result[key]["logits"] = base_touched(got, y, TOKENS)
    if key == "base_rows_touched":
        want = reference(y[:, :16], x, la, lb, 0.5, TOKENS)
        err = (got[:, :16].double() - want).abs().max()
        result["errors"]["logits"] = float(max(err, (got[:, 16:] - y[:, 16:]).abs().max()))
# Layers an adapter has no weights for (vLLM zeroes its slot there; here the buffers hold values, so a
# slot multiplied there shows): slot 1 has none in the fused layer and in the embedding (known by its
# B buffer), no slot has any in the plain one nor in a second embedding.
emb_silent = torch.randn(SLOTS, 1, 16, R)
w = LoraPinPunicaWrapper(64, 16, "cpu")
for slot, rank in enumerate(RANKS):
    w.set_slot(slot, SLOTS, rank, without=[a[0], emb_b] * (slot == 1) + [a1[0], emb_silent])
w.update_metadata(LoRAMapping(TOKENS, TOKENS, is_prefill=True), list(IDS), SLOTS + 1, VOCAB)
skipped = tuple(0 if token == IDS[1] else token for token in TOKENS)
for name, (aa, bb), rows in (("linear_without", (a, b), skipped), ("linear_silent", (a1, b1), (0,) * T)):
    y = torch.randn(T, sum(s.shape[2] for s in bb))
    got = y.clone()
    w.add_lora_linear(got, x, aa, bb, 0.5, tuple(s.shape[2] for s in bb))
    result["errors"][name] = float((got.double() - reference(y, x, aa, bb, 0.5, rows)).abs().max())
for name, emb, rows in (("embedding_without", emb_b, skipped), ("embedding_silent", emb_silent, (0,) * T)):
    y = torch.randn(T, 16)
    got = y.clone()
    w.add_lora_embedding(got, v, emb, add_inputs=True)
    want = y.double().clone()
    for t, token in enumerate(rows):
        if token:
            rank = RANKS[slot_of(token)]
            want[t] += emb[slot_of(token), 0, :, :rank].double() @ v[t, :rank].double()
    result["errors"][name] = float((got.double() - want).abs().max())
print(json.dumps(result))
