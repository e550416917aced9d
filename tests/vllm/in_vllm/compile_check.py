"""Run by tests/vllm/test_punica_compile.py in the vLLM venv (no pytest there): lora_pin's punica wrapper
under ``torch.compile`` as vLLM compiles its forward (one Dynamo trace, dynamic token count, inductor), on a
small model whose layers call the wrapper as vLLM's LoRA layers do (an embedding with LoRA, a fused
q/k/v linear, a plain linear some adapters have no weights for, a linear no adapter has weights for).
Over steps of different token counts and adapter mixes, the metadata updated between steps as vLLM's
model runner does, the compiled model's output is compared with the eager one's. Prints one JSON object:
``{"traced": str, "graphs": int, "steps": [{"tokens": T, "error": float, "base_rows_equal": bool,
"swapped_error": float}], "opcheck": {op: str}, "seam": {case: [mode, VLLM_DISABLE_COMPILE_CACHE]}}``:
per step the compiled output's largest error against the eager one (relative to its largest value),
whether its base rows equal those of the compiled model run with every row on the base model, and the
error the same step shows under another adapter mix (what a graph that baked a step's metadata in would
show); ``opcheck``: ``"ok"`` or the error; ``seam``: the compilation mode
:func:`lora_pin.vllm.seams.keeping_compilation` leaves, per case.
"""

from __future__ import annotations

import json
import os

import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters
from vllm.lora.layers import LoRAMapping

from lora_pin.vllm.punica import LoraPinPunicaWrapper

torch.manual_seed(0)
SLOTS, R, HIDDEN, VOCAB = 3, 8, 32, 40
RANKS = (2, 4, 8)
IDS = (11, 12, 13)  # vLLM's adapter ids in slots 0..2
QKV = (32, 16, 16)


def stacked(
    out_sizes: tuple[int, ...], in_size: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """vLLM's buffers per slice, A ``[slots, 1, R, in]``, B ``[slots, 1, out, R]``, zero past each rank."""
    a_all, b_all = [], []
    for out in out_sizes:
        a = torch.zeros(SLOTS, 1, R, in_size)
        b = torch.zeros(SLOTS, 1, out, R)
        for slot, rank in enumerate(RANKS):
            a[slot, 0, :rank] = torch.randn(rank, in_size)
            b[slot, 0, :, :rank] = torch.randn(out, rank)
        a_all.append(a)
        b_all.append(b)
    return tuple(a_all), tuple(b_all)


class Model(torch.nn.Module):
    """The calls vLLM's LoRA layers make on the wrapper, in a forward of one layer."""

    def __init__(self, wrapper: LoraPinPunicaWrapper) -> None:
        super().__init__()
        self.punica_wrapper = wrapper
        self.embed = torch.randn(VOCAB, HIDDEN)
        # VocabParallelEmbeddingWithLoRA: A as [slots * vocab, R], B [slots, 1, hidden, R].
        self.embed_a = torch.randn(SLOTS * VOCAB, R)
        self.embed_b = stacked((HIDDEN,), R)[1][0]
        self.qkv = torch.randn(sum(QKV), HIDDEN)
        self.qkv_a, self.qkv_b = stacked(QKV, HIDDEN)
        self.o = torch.randn(HIDDEN, HIDDEN)
        self.o_a, self.o_b = stacked((HIDDEN,), HIDDEN)
        self.mlp = torch.randn(HIDDEN, HIDDEN)
        self.mlp_a, self.mlp_b = stacked((HIDDEN,), HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        wrapper = self.punica_wrapper
        num_tokens = ids.shape[0]
        lookup = F.embedding(ids + wrapper._embeddings_indices[:num_tokens], self.embed_a)
        h = F.embedding(ids, self.embed)
        wrapper.add_lora_embedding(h, lookup, self.embed_b, add_input=True)
        h = torch.tanh(h)
        qkv = h @ self.qkv.t()
        wrapper.add_lora_linear(qkv, h, self.qkv_a, self.qkv_b, 1.0, QKV)
        q, k, v = qkv.split(QKV, dim=-1)
        h = torch.relu(q) + torch.cat([k, v], dim=-1).sigmoid()
        o = h @ self.o.t()
        wrapper.add_lora_linear(o, h, self.o_a, self.o_b, 1.0, (HIDDEN,))
        m = torch.tanh(o) @ self.mlp.t()
        wrapper.add_lora_linear(m, o, self.mlp_a, self.mlp_b, 1.0, (HIDDEN,))
        return m + o


wrapper = LoraPinPunicaWrapper(64, 16, "cpu")
model = Model(wrapper)
for slot, rank in enumerate(RANKS):
    # Slot 1's adapter has no weights in o (vLLM zeroes it there: here it holds values, so that a slot
    # multiplied there shows); no adapter has any in the MLP layer.
    without = [model.mlp_a[0]] + [model.o_a[0]] * (slot == 1)
    if slot == 1:
        model.o_a[0][slot].normal_()
        model.o_b[0][slot].normal_()
    model.mlp_a[0][slot].normal_()
    model.mlp_b[0][slot].normal_()
    wrapper.set_slot(slot, SLOTS, rank, without)


def step(tokens: tuple[int, ...]) -> None:
    wrapper.update_metadata(LoRAMapping(tokens, tokens, is_prefill=True), list(IDS), SLOTS + 1, VOCAB)


# vLLM's compiled forward: one trace, the token count dynamic, guards not relied on (DYNAMO_TRACE_ONCE).
compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="inductor")
STEPS = (
    (0, 11, 11, 0, 13, 12, 0, 13, 13, 11, 0, 0),
    (12, 12, 0, 11, 13, 13, 13, 0, 12),  # fewer tokens, another order
    (0,) * 7,  # base only
    (13,) * 5 + (12,) * 11 + (0,) * 3 + (11,) * 4,  # more tokens than the first step
    (11, 0),
)
result: dict[str, object] = {"steps": []}
traced = "ok"
for tokens in STEPS:
    ids = torch.randint(0, VOCAB, (len(tokens),))
    with torch.no_grad():
        step(tokens)
        want = model(ids).double()
        try:
            got = compiled(ids)
            # The same tokens as base-model rows only: the rows without an adapter must not change.
            step((0,) * len(tokens))
            base_only = compiled(ids)
            # The same step under another adapter mix: what a graph that baked the first mix in misses.
            swapped = tuple(IDS[(IDS.index(t) + 1) % 3] if t else 0 for t in tokens)
            step(swapped)
            moved = float((compiled(ids).double() - want).abs().max())
        except Exception as error:  # a graph break under fullgraph=True, or a failed trace
            traced = f"{type(error).__name__}: {str(error)[:2000]}"
            break
    base = [t for t, token in enumerate(tokens) if not token]
    result["steps"].append(
        {
            "tokens": len(tokens),
            # Inductor fuses the rest of the model its own way: against eager to float rounding.
            "error": float((got.double() - want).abs().max() / want.abs().max()),
            "base_rows_equal": torch.equal(got[base], base_only[base]),
            "swapped_error": moved / float(want.abs().max()),
        }
    )
result["traced"] = traced
result["graphs"] = counters["stats"]["unique_graphs"]

# opcheck: schema (y mutated, nothing else), fake bodies, and the ops under make_fx and aot_dispatch.
step(STEPS[0])
T = len(STEPS[0])
x = torch.randn(T, HIDDEN)
opcheck: dict[str, str] = {}
cases = {
    "vllm_lora_linear_": (
        torch.randn(T, sum(QKV)),
        x,
        list(model.qkv_a),
        list(model.qkv_b),
        1.0,
        list(QKV),
        True,
        wrapper._handle,
    ),
    "vllm_lora_embedding_": (torch.randn(T, HIDDEN), torch.randn(T, R), model.embed_b, True, wrapper._handle),
}
for name, args in cases.items():
    try:
        torch.library.opcheck(getattr(torch.ops.lora_pin, name).default, args)
        opcheck[name] = "ok"
    except Exception as error:
        opcheck[name] = f"{type(error).__name__}: {str(error)[:2000]}"
result["opcheck"] = opcheck

# The seam's decision (lora_pin.vllm.seams.keeping_compilation) around a stand-in for the platform's
# check, which does what vLLM 0.32's does to the mode (the contract test checks that it still does).
from types import SimpleNamespace  # noqa: E402

from vllm.config import CompilationMode  # noqa: E402

from lora_pin.vllm.seams import COMPILE_ENV, keeping_compilation  # noqa: E402


def platform_check(cls: object, config: SimpleNamespace) -> None:
    compilation = config.compilation_config
    if compilation.mode == CompilationMode.VLLM_COMPILE:
        compilation.mode = CompilationMode.DYNAMO_TRACE_ONCE
    if config.lora_config is not None:
        compilation.mode = CompilationMode.NONE


seam: dict[str, list[object]] = {}
for name, env, requested, lora in (
    ("on", "1", CompilationMode.VLLM_COMPILE, SimpleNamespace(fully_sharded_loras=False)),
    ("unset", None, CompilationMode.VLLM_COMPILE, SimpleNamespace(fully_sharded_loras=False)),
    ("off", "0", CompilationMode.VLLM_COMPILE, SimpleNamespace(fully_sharded_loras=False)),
    ("misspelt", "yes", CompilationMode.VLLM_COMPILE, SimpleNamespace(fully_sharded_loras=False)),
    ("fully_sharded", None, CompilationMode.VLLM_COMPILE, SimpleNamespace(fully_sharded_loras=True)),
    ("enforce_eager", None, CompilationMode.NONE, SimpleNamespace(fully_sharded_loras=False)),
    ("no_lora", None, CompilationMode.VLLM_COMPILE, None),
):
    for key in (COMPILE_ENV, "VLLM_DISABLE_COMPILE_CACHE"):
        os.environ.pop(key, None)
    if env is not None:
        os.environ[COMPILE_ENV] = env
    config = SimpleNamespace(compilation_config=SimpleNamespace(mode=requested), lora_config=lora)
    try:
        keeping_compilation(platform_check)(None, config)
    except ValueError as e:
        seam[name] = [f"ValueError: {e}", os.environ.get("VLLM_DISABLE_COMPILE_CACHE")]
        continue
    seam[name] = [config.compilation_config.mode.name, os.environ.get("VLLM_DISABLE_COMPILE_CACHE")]
result["seam"] = seam
print(json.dumps(result))
