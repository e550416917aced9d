"""LoRA on MoE experts (PEFT ``target_parameters``) against PEFT, on tiny Mixtral, Qwen3-MoE and OLMoE.

PEFT cannot run a mixed batch when an adapter has ``target_parameters`` (``ParamWrapper`` refuses
``adapter_names``) and cannot hold two such adapters targeting different weights, so the oracle is one
PEFT model per adapter, run on that adapter's rows alone; every sequence is independent of the others
(same length, no padding). Base rows are checked against the base model: exactly, at the experts module,
for a given routing; at the model's output within fp32 tolerance, since adapter tokens route differently
from a plain run, which changes the per-expert GEMM shapes the base rows share.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError, PoolError, SpecError
from lora_pin.fixtures import save_peft_adapter
from lora_pin.model.experts import LoRAExperts

# PEFT applies rank_pattern to a target parameter by its key (the "experts" adapter's down_proj has rank
# 2), but its unmatched-keys warning looks at module names only.
pytestmark = pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match:RuntimeWarning")

VOCAB = 96
BOTH = ["experts.gate_up_proj", "experts.down_proj"]


def tiny_moe(family: str) -> torch.nn.Module:
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shape: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
    }
    torch.manual_seed(0)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=24, num_local_experts=4, **shape))
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(
            intermediate_size=40, moe_intermediate_size=20, num_experts=6, head_dim=8, **shape
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = OlmoeForCausalLM(
            OlmoeConfig(intermediate_size=16, num_experts=5, pad_token_id=0, eos_token_id=1, **shape)
        )
    return model.eval()


SPECS: dict[str, dict[str, Any]] = {
    # Experts only: both weights, rank per weight from rank_pattern by the parameter's key.
    "experts": {"r": 4, "lora_alpha": 8, "target_parameters": BOTH, "rank_pattern": {"down_proj": 2}},
    # One weight only (PEFT saves it unnested), rslora.
    "down": {"r": 3, "lora_alpha": 5, "target_parameters": ["experts.down_proj"], "use_rslora": True},
    # Experts and attention.
    "mixed": {"r": 2, "lora_alpha": 3, "target_modules": ["q_proj", "v_proj"], "target_parameters": BOTH},
    "attn": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj"]},
    # layers_to_transform limits the modules, not the parameters (PEFT's rule): gate_up_proj in every layer.
    "layer0": {
        "r": 2,
        "lora_alpha": 2,
        "target_modules": ["q_proj"],
        "layers_to_transform": [0],
        "target_parameters": ["experts.gate_up_proj"],
    },
}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "olmoe"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tiny_moe(request.param)
    root = tmp_path_factory.mktemp("moe_adapters")
    adapters = {
        name: save_peft_adapter(base, root / name, i + 1, scale=0.2, **spec)
        for i, (name, spec) in enumerate(SPECS.items())
    }
    return base, adapters


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def peft_rows(base: torch.nn.Module, adapter: Path, tokens: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    oracle = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).eval()
    with torch.no_grad():
        return oracle(input_ids=tokens).logits


def test_mixed_batches_match_peft_per_adapter(world: Any) -> None:
    base, adapters = world
    names: list[str | None] = ["experts", None, "down", "mixed", "attn", None, "layer0", "experts", "mixed"]
    tokens = ids(len(names), 5)
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=len(adapters))
    assert any(isinstance(m, LoRAExperts) for m in model.modules())
    with torch.no_grad(), mgr.batch(names):
        got = model(input_ids=tokens).logits
    with torch.no_grad():
        plain = base(input_ids=tokens).logits
    for name in {n for n in names if n is not None}:
        rows = [i for i, n in enumerate(names) if n == name]
        want = peft_rows(base, adapters[name], tokens[rows])
        assert not torch.allclose(want, plain[rows], atol=1e-3), f"adapter {name} changes nothing"
        torch.testing.assert_close(got[rows], want, rtol=1e-4, atol=1e-5, msg=f"adapter {name}")
    base_rows = [i for i, n in enumerate(names) if n is None]
    torch.testing.assert_close(got[base_rows], plain[base_rows], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, plain), "outside a step the model is the base"


def test_base_rows_are_peft_base_rows_beside_an_attention_adapter(world: Any) -> None:
    """Beside adapters without expert LoRA, PEFT can run the mixed batch; with expert adapters loaded in
    the manager, its base rows (and the attention adapter's) equal PEFT's, base rows bit for bit."""
    from peft import PeftModel

    base, adapters = world
    names: list[str | None] = ["attn", None, "attn", None, None]
    tokens = ids(len(names), 4, seed=3)
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters["attn"]), adapter_name="attn")
    with torch.no_grad():
        want = oracle.eval()(input_ids=tokens, adapter_names=[n or "__base__" for n in names]).logits
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"e={adapters['experts']}", f"attn={adapters['attn']}"], max_loras_per_batch=2)
    with torch.no_grad(), mgr.batch(["e"]):  # the expert adapter now holds a slot
        model(input_ids=tokens[:1])
    with torch.no_grad(), mgr.batch(names):
        got = model(input_ids=tokens).logits
    for row, name in enumerate(names):
        if name is None:
            assert torch.equal(got[row], want[row]), f"base row {row} differs from PEFT's __base__ row"
        torch.testing.assert_close(got[row], want[row], rtol=1e-4, atol=1e-5)


def test_one_token_steps_and_adapters_in_every_row(world: Any) -> None:
    base, adapters = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"e={adapters['experts']}", f"m={adapters['mixed']}"], max_loras_per_batch=2)
    for names, length in ((["e", "m", "m", "e"], 1), (["m", "e", "e"], 4)):
        tokens = ids(len(names), length, seed=len(names))
        with torch.no_grad(), mgr.batch(names):
            got = model(input_ids=tokens).logits
        for short, name in (("e", "experts"), ("m", "mixed")):
            rows = [i for i, n in enumerate(names) if n == short]
            torch.testing.assert_close(
                got[rows], peft_rows(base, adapters[name], tokens[rows]), rtol=1e-4, atol=1e-5
            )


def test_base_rows_are_the_experts_modules_own_for_the_same_routing(world: Any) -> None:
    """At the experts module, with the routing given, base tokens' rows are bit-identical to the module's
    own forward over the same batch, whatever its experts implementation; so are the rows of an adapter
    without expert LoRA; the expert adapter's rows are not."""
    base, adapters = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"e={adapters['experts']}", f"a={adapters['attn']}"], max_loras_per_batch=2)
    wrapper = next(m for m in model.modules() if isinstance(m, LoRAExperts))
    experts = wrapper.base_layer
    gen = torch.Generator().manual_seed(1)
    names = ["e", None, "a", None, None, "e", "e", "a", "e", None]
    hidden = torch.randn(len(names), base.config.hidden_size, generator=gen)
    top_k_index = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:2] for _ in names])
    top_k_weights = torch.rand(len(names), 2, generator=gen)
    with torch.no_grad():
        want = experts(hidden, top_k_index, top_k_weights)
        with mgr.batch(names):
            got = wrapper(hidden, top_k_index, top_k_weights)
    unchanged = torch.tensor([n != "e" for n in names])
    assert torch.equal(got[unchanged], want[unchanged])
    changed = (got[~unchanged] - want[~unchanged]).abs().amax()
    assert changed > 0.01 * want.abs().amax(), "the adapter's expert LoRA changed nothing"


def test_target_parameters_select_expert_weights_not_shared_linears(world: Any) -> None:
    base, adapters = world
    mgr = LoRAManager(copy.deepcopy(base), [f"down={adapters['down']}"], max_loras_per_batch=1)
    keys = [t.key for t in mgr.targets.linears]
    assert keys and all(k.endswith(".mlp.experts.down_proj") for k in keys), keys
    experts = next(m for m in base.modules() if type(m).__name__.endswith("Experts"))
    assert all(t.experts == experts.num_experts for t in mgr.targets.linears)


def test_expert_weights_count_toward_the_adapters_bytes(world: Any) -> None:
    base, adapters = world
    mgr = LoRAManager(copy.deepcopy(base), [f"m={adapters['mixed']}"], max_loras_per_batch=1)
    stored = load_file(adapters["mixed"] / "adapter_model.safetensors")
    assert any("experts" in k for k in stored)
    assert mgr.host["m"].device_bytes == sum(t.numel() * t.element_size() for t in stored.values())


def test_all_leaves_expert_weights_out_and_says_how_to_serve_them(world: Any) -> None:
    base, adapters = world
    mgr = LoRAManager(copy.deepcopy(base), [], max_lora_rank=4, lora_target_modules=["all"])
    assert not any(t.experts for t in mgr.targets.linears)
    with pytest.raises(
        AdapterLoadError, match=r"'target_parameters' names.*experts.*not served: .*naming it"
    ):
        mgr.load("e", adapters["experts"])
    assert "e" not in mgr.host


def test_an_expert_weight_named_in_lora_target_modules_is_served(world: Any) -> None:
    base, adapters = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model, [], max_lora_rank=4, max_loras_per_batch=2, lora_target_modules=["experts.down_proj"]
    )
    mgr.load("down", adapters["down"])
    with pytest.raises(AdapterLoadError, match=r"gate_up_proj.*not served"):
        mgr.load("experts", adapters["experts"])
    tokens = ids(2, 3, seed=9)
    with torch.no_grad(), mgr.batch(["down", "down"]):
        got = model(input_ids=tokens).logits
    torch.testing.assert_close(got, peft_rows(base, adapters["down"], tokens), rtol=1e-4, atol=1e-5)


def test_expert_weights_cannot_be_paged_and_are_refused_by_name(world: Any) -> None:
    """A slot holds every expert's ranks of an experts group: a paged pool refuses the group by name."""
    base, _ = world
    with pytest.raises(PoolError, match=r"target '.*experts.down_proj' cannot be paged: MoE expert weights"):
        LoRAManager(
            copy.deepcopy(base),
            max_lora_rank=4,
            lora_target_modules=["experts.down_proj"],
            page_rank=4,
            max_lora_memory="64MiB",
        )


def _copy_adapter(source: Path, folder: Path, edit_config: Any = None, edit_tensors: Any = None) -> Path:
    folder.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    if edit_config is not None:
        edit_config(config)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(source / "adapter_model.safetensors")
    if edit_tensors is not None:
        tensors = edit_tensors(tensors)
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _drop_down(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if "experts.lora_" not in k}


def _wrong_rank(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[:-1] if k.endswith("experts.base_layer.lora_A.weight") else v for k, v in tensors.items()}


def _nan(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    key = next(k for k in tensors if k.endswith("experts.lora_B.weight"))
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    return tensors


@pytest.mark.parametrize(
    ("edit_config", "edit_tensors", "message"),
    [
        (
            lambda c: c.update(target_parameters=["experts.up_proj"]),
            None,
            r"names 'experts.up_proj', which is not",
        ),
        (
            lambda c: c.update(target_parameters="experts.down_proj"),
            None,
            r"'target_parameters' must be a list",
        ),
        (
            lambda c: c.update(rank_pattern={}),
            None,
            r"rank 2 per expert but field 'r'/'rank_pattern' gives 4",
        ),
        (None, _drop_down, r"expert weight '.*experts.down_proj', which has no tensors"),
        (None, _wrong_rank, r"do not fit expert weight '.*gate_up_proj'"),
        (None, _nan, r"NaN/Inf"),
    ],
    ids=["unknown-weight", "not-a-list", "rank", "missing", "shape", "nan"],
)
def test_bad_expert_adapters_are_refused_and_change_nothing(
    world: Any, tmp_path: Path, edit_config: Any, edit_tensors: Any, message: str
) -> None:
    base, adapters = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"experts={adapters['experts']}"], max_loras_per_batch=2)
    before = {k: (v.a.clone(), v.b.clone()) for k, v in mgr.pool._buffers.items()}
    bad = _copy_adapter(adapters["experts"], tmp_path / "bad", edit_config, edit_tensors)
    with pytest.raises(AdapterLoadError, match=message):
        mgr.load("bad", bad)
    assert "bad" not in mgr.host and list(mgr.host) == ["experts"]
    for key, (a, b) in before.items():
        assert torch.equal(mgr.pool._buffers[key].a, a) and torch.equal(mgr.pool._buffers[key].b, b)


def test_an_experts_module_lora_pin_cannot_compute_is_refused_when_named() -> None:
    class BiasedExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 4))
            self.has_bias = True
            self.act_fn = torch.nn.SiLU()

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)
            self.experts = BiasedExperts()

    with pytest.raises(
        SpecError, match=r"'experts.down_proj' cannot be served: BiasedExperts: its experts add"
    ):
        LoRAManager(Block(), [], max_lora_rank=2, lora_target_modules=["q_proj", "experts.down_proj"])
    mgr = LoRAManager(Block(), [], max_lora_rank=2, lora_target_modules=["q_proj"])
    assert "experts.down_proj" in mgr.targets.unserved


def test_module_names_never_select_expert_weights() -> None:
    """An adapter's target_modules ``down_proj`` (a shared expert's linear, say) does not make the routed
    experts' ``down_proj`` weight a pool target; its target_parameters, or a name in lora_target_modules,
    does."""
    from lora_pin.weights.targets import ModuleSelection

    key = "model.layers.0.mlp.experts.down_proj"
    assert not ModuleSelection.of(["down_proj"]).selects_parameter(key)
    assert ModuleSelection.of([], ["experts.down_proj"]).selects_parameter(key)
    assert ModuleSelection.of(["down_proj"], ["down_proj"]).selects_parameter(key)
    assert not ModuleSelection.of(["up_proj"], ["gate_up_proj"]).selects_parameter(key)


def test_inspect_summarises_an_expert_adapter_and_checks_it_against_the_model(
    world: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from lora_pin.cli import inspect_cmd

    base, adapters = world
    model_dir = tmp_path / "model"
    base.save_pretrained(model_dir)

    def inspect(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        inspect_cmd.add_parser(parser.add_subparsers())
        args = parser.parse_args(["inspect", *argv])
        assert args.run(args) == 0
        return capsys.readouterr().out

    for extra in ([], ["--model", str(model_dir)]):
        out = inspect(str(adapters["mixed"]), "--dtype", "float32", *extra)
        assert "rank:           2\n" in out and "target modules: q_proj, v_proj" in out
        line = next(x for x in out.splitlines() if x.startswith("expert weights: "))
        assert sorted(line.removeprefix("expert weights: ").split(", ")) == sorted(BOTH)
        stored = load_file(adapters["mixed"] / "adapter_model.safetensors")
        assert f"device bytes:   {sum(t.numel() for t in stored.values()) * 4} (float32)" in out
    out = inspect(str(adapters["experts"]), "--model", str(model_dir))
    assert "rank:           2, 4" in out and "target modules: none" in out and "(validated)" in out
    with pytest.raises(AdapterLoadError, match=r"ranks above the max rank 3: \{'experts.gate_up_proj': 4\}"):
        inspect(str(adapters["experts"]), "--max-rank", "3")


# ---------------------------------------------------------------- Llama 4: [E, H, 2I] / [E, I, H] experts


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Llama 4 text model: its experts module takes the routed hidden states alone ([E * T, H], each
    token's row once per expert, scaled by its routing weight) and multiplies by gate_up_proj [E, H, 2I] and
    down_proj [E, I, H]; its router is an nn.Linear subclass returning a tuple."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=12,
        intermediate_size_mlp=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        max_position_embeddings=64,
        moe_layers=[0, 1],
        interleave_moe_layer_step=1,
    )
    torch.manual_seed(0)
    base = Llama4ForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("llama4_adapters")
    adapters = {
        name: save_peft_adapter(base, root / name, i + 1, scale=0.2, **spec)
        for i, (name, spec) in enumerate(SPECS.items())
    }
    return base, adapters


def test_llama4_dense_experts_match_peft_per_adapter(llama4: Any) -> None:
    base, adapters = llama4
    names: list[str | None] = ["experts", None, "down", "mixed", "attn", None, "layer0", "experts", "mixed"]
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=len(adapters))
    assert sum(isinstance(m, LoRAExperts) for m in model.modules()) == 2
    for length in (5, 1):
        tokens = ids(len(names), length, seed=length)
        with torch.no_grad(), mgr.batch(names):
            got = model(input_ids=tokens).logits
        with torch.no_grad():
            plain = base(input_ids=tokens).logits
        for name in {n for n in names if n is not None}:
            rows = [i for i, n in enumerate(names) if n == name]
            want = peft_rows(base, adapters[name], tokens[rows])
            assert not torch.allclose(want, plain[rows], atol=1e-3), f"adapter {name} changes nothing"
            torch.testing.assert_close(got[rows], want, rtol=1e-4, atol=1e-5, msg=f"adapter {name}")
        base_rows = [i for i, n in enumerate(names) if n is None]
        # Llama 4 routes every token through every expert (scaled): base rows are the model's own.
        assert torch.equal(got[base_rows], plain[base_rows])
