"""LoRA on the output layer (``lm_head``) and the input embedding (``embed_tokens``), against PEFT.

PEFT's mixed-batch forward (``model(..., adapter_names=[...])``) is the oracle. The adapters are saved by
PEFT's own ``save_pretrained`` with its defaults, so their files also hold the copies of the embedding
layers' base weights PEFT adds when ``target_modules`` names one. Tiny models: a Llama untied, a Llama
with ``tie_word_embeddings`` (lm_head's weight is the embedding's: LoRA on one must not touch the other),
and a Gemma 3 (tied, with a scaled embedding whose scale PEFT applies to the delta too).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import save_peft_adapter

# Each test compiles from a clean slate (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

VOCAB = 96


def tiny_model(family: str) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
    }
    torch.manual_seed(0)
    if family == "gemma3":
        # Tied, and a scaled embedding (its forward multiplies by embed_scale, PEFT's delta too).
        return Gemma3ForCausalLM(Gemma3TextConfig(head_dim=8, **shape)).eval()
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=family == "llama-tied", **shape)).eval()


SPECS: dict[str, dict[str, Any]] = {
    "head": {"r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]},
    "embed": {"r": 2, "lora_alpha": 3, "target_modules": ["embed_tokens"]},
    "both": {"r": 3, "lora_alpha": 6, "target_modules": ["embed_tokens", "lm_head", "q_proj", "v_proj"]},
    "qv": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
}


@pytest.fixture(scope="module", params=["llama-untied", "llama-tied", "gemma3"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tiny_model(request.param)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: save_peft_adapter(base, root / name, i + 1, **spec)
        for i, (name, spec) in enumerate(SPECS.items())
    }
    return base, adapters


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_mixed_batch_matches_peft_and_base_rows_are_the_base_models(world: Any) -> None:
    from peft import PeftModel

    base, adapters = world
    first, *rest = adapters
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters[first]), adapter_name=first)
    for other in rest:
        oracle.load_adapter(str(adapters[other]), adapter_name=other)
    oracle.eval()
    names: list[str | None] = ["head", None, "embed", "both", "qv", None, "both"]
    tokens = ids(len(names), 5)
    with torch.no_grad():
        want = oracle(input_ids=tokens, adapter_names=[n or "__base__" for n in names]).logits
        plain = base(input_ids=tokens).logits

    model = copy.deepcopy(base)
    embedding_before = model.get_input_embeddings().weight.detach().clone()
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=len(adapters))
    assert {"lm_head", "embed_tokens", "q_proj", "v_proj"} <= set(mgr.targets.module_names)
    with torch.no_grad(), mgr.batch(names):
        got = model(input_ids=tokens).logits
    for row, name in enumerate(names):
        if name is None:
            assert torch.equal(got[row], plain[row]), f"base row {row} differs from the base model's"
        else:
            assert not torch.allclose(want[row], plain[row], atol=1e-4), f"adapter {name} changes nothing"
        torch.testing.assert_close(got[row], want[row], rtol=1e-4, atol=1e-5, msg=f"row {row} ({name})")

    # Neither wrapper wrote into the base weights, tied or not.
    assert torch.equal(model.get_input_embeddings().weight, embedding_before)
    head_weight = model.get_output_embeddings().weight
    tied = base.config.tie_word_embeddings
    assert (head_weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()) == tied
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, plain)


def test_one_token_steps_match_peft(world: Any) -> None:
    """One token per sequence (a decode step's shape) takes the planner's own segments, not the per-length
    ones: the embedding lookup follows those too, in either order of adapters across the batch."""
    from peft import PeftModel

    base, adapters = world
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters["both"]), adapter_name="both")
    oracle.load_adapter(str(adapters["embed"]), adapter_name="embed")
    oracle.eval()
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model, [f"both={adapters['both']}", f"embed={adapters['embed']}"], max_loras_per_batch=2
    )
    for names in (["both", None, "embed", "both"], ["embed", "both", None, "embed"]):
        tokens = ids(len(names), 1, seed=len(names))
        with torch.no_grad():
            want = oracle(input_ids=tokens, adapter_names=[n or "__base__" for n in names]).logits
            with mgr.batch(names):
                got = model(input_ids=tokens).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_all_leaves_lm_head_and_embeddings_out(world: Any) -> None:
    base, adapters = world
    mgr = LoRAManager(copy.deepcopy(base), [], max_lora_rank=4, lora_target_modules=["all"])
    assert not {"lm_head", "embed_tokens"} & set(mgr.targets.module_names)
    with pytest.raises(AdapterLoadError, match=r"'lm_head'.*not served: .*\['all'\] leaves out"):
        mgr.load("head", adapters["head"])
    with pytest.raises(AdapterLoadError, match=r"'model.embed_tokens'.*not served: .*\['all'\] leaves out"):
        mgr.load("embed", adapters["embed"])
    assert "head" not in mgr.host and "embed" not in mgr.host


def test_a_changed_base_weight_copy_is_refused(world: Any, tmp_path: Path) -> None:
    """PEFT saves the embedding layers' base weights beside the LoRA tensors; a copy that differs from the
    model's (a resized or retrained embedding) would change the output and is refused, not ignored."""
    base, adapters = world
    folder = tmp_path / "changed"
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes((adapters["embed"] / "adapter_config.json").read_bytes())
    tensors = load_file(adapters["embed"] / "adapter_model.safetensors")
    copies = [k for k in tensors if k.endswith(".base_layer.weight")]
    assert copies, "PEFT no longer saves the base embedding: this test checks nothing"
    tensors[copies[0]] = tensors[copies[0]] + 1.0
    save_file(tensors, folder / "adapter_model.safetensors")
    mgr = LoRAManager(copy.deepcopy(base), [f"embed={adapters['embed']}"], max_loras_per_batch=2)
    with pytest.raises(AdapterLoadError, match=r"base_layer\.weight.*differs from the model's"):
        mgr.load("changed", folder)
    assert "changed" not in mgr.host


def test_embedding_tensors_on_a_linear_are_refused(world: Any, tmp_path: Path) -> None:
    base, adapters = world
    folder = tmp_path / "swapped"
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes((adapters["qv"] / "adapter_config.json").read_bytes())
    tensors = load_file(adapters["qv"] / "adapter_model.safetensors")
    renamed = {
        k.replace(".lora_A.weight", ".lora_embedding_A").replace(".lora_B.weight", ".lora_embedding_B")
        if ".layers.0.self_attn.q_proj." in k
        else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, folder / "adapter_model.safetensors")
    mgr = LoRAManager(copy.deepcopy(base), [f"qv={adapters['qv']}"], max_loras_per_batch=2)
    with pytest.raises(AdapterLoadError, match=r"are an embedding's, but module .*q_proj' is a linear layer"):
        mgr.load("swapped", folder)


def test_adapters_loaded_later_into_a_manager_naming_both(world: Any) -> None:
    """No start-up adapter: lora_target_modules= alone makes lm_head and the embedding targets, and a slot
    filled after a q/v-only occupant holds none of its weights (the lm_head part of "qv" is rank 0)."""
    from peft import PeftModel

    base, adapters = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model,
        [],
        max_loras_per_batch=1,
        max_lora_rank=4,
        lora_target_modules=["lm_head", "embed_tokens", "q_proj", "v_proj"],
    )
    tokens = ids(2, 3, seed=5)
    for name in ("both", "qv", "head", "embed"):
        mgr.load(name, adapters[name])
        oracle = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters[name]), adapter_name=name).eval()
        with torch.no_grad():
            want = oracle(input_ids=tokens, adapter_names=[name, "__base__"]).logits
            with mgr.batch([name, None]):
                got = model(input_ids=tokens).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_from_model_takes_lm_head_only_when_named(world: Any) -> None:
    from lora_pin.weights import LoRATargets

    base, _ = world
    assert "lm_head" in LoRATargets.from_model(base, ["lm_head", "q_proj"]).module_names
    assert "lm_head" not in LoRATargets.from_model(base, "all-linear").module_names


def test_fullgraph_compile_equals_eager(world: Any) -> None:
    """The embedding lookup derives its row slots without a data-dependent shape: one graph, no break."""
    base, adapters = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model, [f"both={adapters['both']}", f"embed={adapters['embed']}"], max_loras_per_batch=2
    )
    names: list[str | None] = ["both", None, "embed", "both"]
    tokens = ids(4, 6, seed=2)

    def run(m: Any) -> list[torch.Tensor]:
        with torch.no_grad(), mgr.batch(names):
            return [m(input_ids=tokens).logits, m(input_ids=tokens[:, -1:]).logits]

    want = run(model)
    got = run(torch.compile(model, fullgraph=True, backend="aot_eager"))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
