"""DoRA adapters served in mixed batches, against PEFT's own forward as the oracle.

PEFT refuses ``adapter_names`` with DoRA, so every adapter row is compared with PEFT's single-adapter
forward of the same batch (that adapter active), and every base row with the plain model bit for bit.
Three architectures: Llama (the session's tiny one), Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``
modules) and Qwen2 (q/k/v biases, which DoRA rescales around), in fp32 and bf16, prefill and a decode
step, and after the DoRA adapter was evicted from its slot and from host memory and loaded again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin import LoRAManager
from lora_pin.fixtures import save_peft_adapter

# Each test compiles from a clean slate (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TOLERANCE = {torch.float32: (2e-4, 2e-5), torch.bfloat16: (6e-2, 6e-2)}


def plain_twin(dora_dir: Path, out_dir: Path) -> Path:
    """The same A and B as the DoRA adapter at ``dora_dir``, as a plain LoRA adapter (no magnitudes)."""
    out_dir.mkdir()
    tensors = load_file(str(dora_dir / "adapter_model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if "lora_magnitude_vector" not in k},
        str(out_dir / "adapter_model.safetensors"),
    )
    config = json.loads((dora_dir / "adapter_config.json").read_text())
    (out_dir / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    return out_dir


def peft_oracles(base: torch.nn.Module, adapters: Mapping[str, Path]) -> dict[str, torch.nn.Module]:
    """PEFT's model of ``base`` with each adapter alone (PEFT refuses ``adapter_names`` with DoRA)."""
    from peft import PeftModel

    return {
        name: PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()
        for name, path in adapters.items()
        if name != "twin"
    }


def peft_rows(
    oracles: Mapping[str, torch.nn.Module], names: list[str | None], run: Callable[..., Any]
) -> dict[str, Any]:
    """Per adapter named in ``names``: PEFT's output of the whole batch with that adapter alone active."""
    with torch.no_grad():
        return {name: run(oracles[name]) for name in dict.fromkeys(n for n in names if n is not None)}


def check_rows(
    got: torch.Tensor,
    want: Mapping[str, torch.Tensor],
    plain: torch.Tensor,
    names: list[str | None],
    dtype: torch.dtype,
) -> None:
    rtol, atol = TOLERANCE[dtype]
    for row, name in enumerate(names):
        if name is None:
            assert torch.equal(got[row], plain[row]), f"base row {row} differs from the base model's"
            continue
        assert not torch.allclose(want[name][row], plain[row], atol=1e-3), f"{name} changes nothing"
        torch.testing.assert_close(
            got[row].float(), want[name][row].float(), rtol=rtol, atol=atol, msg=f"row {row} ({name})"
        )


# ------------------------------------------------------------------------------------------ models


def _tiny(family: str, tiny_llama: torch.nn.Module) -> torch.nn.Module:
    if family == "llama":
        return copy.deepcopy(tiny_llama).eval()
    torch.manual_seed(1)
    if family == "phi3":
        from transformers import Phi3Config, Phi3ForCausalLM

        config = Phi3Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
            max_position_embeddings=64,
            pad_token_id=0,
        )
        return Phi3ForCausalLM(config).eval()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)  # zero at init: a bias handled wrongly would not show
    return model


TARGETS = {
    "llama": (
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ["q_proj", "down_proj"],
    ),
    "phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj"]),
    "qwen2": (["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"], ["k_proj", "v_proj"]),
}


Served = dict[str, tuple[torch.nn.Module, dict[str, Path], dict[str, torch.nn.Module]]]


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    """Per family: the tiny fp32 model, its adapters (``dora``: every target, rank pattern; ``dora_rs``:
    rsLoRA, alpha pattern, a few targets; ``lora``: plain; ``twin``: ``dora``'s A and B as plain LoRA)
    and PEFT's model with each adapter."""
    tiny_llama = request.getfixturevalue("tiny_llama")
    made = {}
    for family, (everything, few) in TARGETS.items():
        base = _tiny(family, tiny_llama)
        root = tmp_path_factory.mktemp(f"dora-{family}")
        adapters = {
            "dora": save_peft_adapter(
                base,
                root / "dora",
                1,
                r=4,
                lora_alpha=8,
                target_modules=everything,
                rank_pattern={everything[-1]: 2},
                use_dora=True,
            ),
            "dora_rs": save_peft_adapter(
                base,
                root / "dora_rs",
                2,
                r=8,
                lora_alpha=4,
                target_modules=few,
                use_rslora=True,
                alpha_pattern={few[0]: 16},
                use_dora=True,
            ),
            "lora": save_peft_adapter(base, root / "lora", 3, r=4, lora_alpha=8, target_modules=everything),
        }
        adapters["twin"] = plain_twin(adapters["dora"], root / "twin")
        made[family] = (base, adapters, peft_oracles(base, adapters))
    return made


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


NAMES: list[str | None] = ["dora", None, "lora", "dora_rs", "dora", None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(TARGETS))
def test_mixed_batch_prefill_and_decode_equal_peft(served: Served, family: str, dtype: torch.dtype) -> None:
    base, adapters, oracles = served[family]
    base = copy.deepcopy(base).to(dtype)
    if dtype != torch.float32:
        oracles = {name: copy.deepcopy(oracle).to(dtype) for name, oracle in oracles.items()}
    prompt, step = _ids(len(NAMES), 5), _ids(len(NAMES), 1, seed=1)

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        first = model(input_ids=prompt, use_cache=True)
        mask = torch.ones(len(NAMES), 6, dtype=torch.long)
        second = model(input_ids=step, cache=first.cache, attention_mask=mask)
        return first.logits, second.logits

    want = peft_rows(oracles, NAMES, run)
    with torch.no_grad():
        plain = run(base)
    model = copy.deepcopy(base)
    served_names = ["dora", "dora_rs", "lora"]
    mgr = LoRAManager(model, [f"{n}={adapters[n]}" for n in served_names], max_loras_per_batch=3)
    with torch.no_grad(), mgr.batch(NAMES):
        got = run(model)
    for phase in (0, 1):
        check_rows(got[phase], {n: w[phase] for n, w in want.items()}, plain[phase], NAMES, dtype)


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_lora_rows_unchanged_by_dora_rows(served: Served, family: str) -> None:
    """The same batch with the DoRA adapter's rows served by its plain twin (same A, B and slot): every
    other row is bit for bit the same, and the DoRA rows differ from the twin's."""
    base, adapters, _ = served[family]
    ids = _ids(4, 5)
    outputs = []
    for first in ("dora", "twin"):
        model = copy.deepcopy(base)
        mgr = LoRAManager(
            model, [f"{first}={adapters[first]}", f"lora={adapters['lora']}"], max_loras_per_batch=2
        )
        with torch.no_grad(), mgr.batch([first, "lora", None, first]):
            outputs.append(model(input_ids=ids).logits)
    dora, twin = outputs
    assert torch.equal(dora[1:3], twin[1:3])
    assert not torch.allclose(dora[0], twin[0], atol=1e-3)


def test_served_again_after_slot_and_host_eviction(served: Served) -> None:
    """One slot and two host entries for three adapters: the DoRA adapter is evicted from its slot and
    from host memory, read again (its factors computed again) and still gives PEFT's output."""
    base, adapters, oracles = served["qwen2"]
    ids = _ids(2, 4)

    def run(model: torch.nn.Module) -> torch.Tensor:
        return model(input_ids=ids).logits

    want = peft_rows(oracles, ["dora", "dora"], run)
    with torch.no_grad():
        plain = run(base)
    model = copy.deepcopy(base)
    names = ["dora", "dora_rs"]
    mgr = LoRAManager(model, [f"{n}={adapters[n]}" for n in names], max_loras_per_batch=1, max_loaded_loras=2)
    first_factor = None
    for name in ["dora", "dora_rs", "lora", "dora"]:
        if name == "lora":
            mgr.load("lora", adapters["lora"])
        with torch.no_grad(), mgr.batch([name, None]):
            got = run(model)
        if name == "dora":
            check_rows(got, want, plain, ["dora", None], torch.float32)
            factors = mgr.pool.group_buffers("model.layers.0.self_attn.q_proj").factors
            assert factors is not None
            if first_factor is None:
                first_factor = factors[0].clone()
            else:
                assert torch.equal(factors[0], first_factor)
    evictions = mgr.stats()["evictions_by_adapter"]
    assert evictions.get("dora/host", 0) >= 1 and evictions.get("dora/device", 0) >= 1, evictions


@pytest.mark.slow
def test_fullgraph_compile_with_dora_rows_equals_eager(served: Served) -> None:
    """Traced, the DoRA rows are every adapter row with the op's flag filter (no host read)."""
    base, adapters, _ = served["qwen2"]
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"{n}={adapters[n]}" for n in ("dora", "lora")], max_loras_per_batch=2)
    names: list[str | None] = ["dora", None, "lora", "dora"]
    ids = _ids(4, 5)

    def run(forward: Any) -> list[torch.Tensor]:
        with torch.no_grad(), mgr.batch(names):
            return [forward(ids).logits, forward(ids[:, -1:]).logits]

    want = run(model)
    got = run(torch.compile(model, fullgraph=True, backend="aot_eager"))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_gpt2_conv1d_fused_c_attn_with_biases_equals_peft(tmp_path: Path) -> None:
    """GPT-2: ``Conv1D`` layers store ``[in, out]`` (PEFT's ``fan_in_fan_out``), ``c_attn`` computes q, k and
    v in one module, and every layer has a bias."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=96)).eval()
    with torch.no_grad():
        for name, param in base.named_parameters():
            if name.endswith(("c_attn.bias", "c_proj.bias", "c_fc.bias")):
                param.normal_(0.0, 0.5)
    adapters = {
        "dora": save_peft_adapter(
            base,
            tmp_path / "dora",
            4,
            r=4,
            lora_alpha=8,
            target_modules=["c_attn", "c_proj", "c_fc"],
            fan_in_fan_out=True,
            use_dora=True,
        ),
        "lora": save_peft_adapter(
            base, tmp_path / "lora", 5, r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True
        ),
    }
    names: list[str | None] = ["dora", None, "lora", "dora"]
    ids = _ids(4, 5)

    def run(model: torch.nn.Module) -> torch.Tensor:
        return model(input_ids=ids).logits

    want = peft_rows(peft_oracles(base, adapters), names, run)
    with torch.no_grad():
        plain = run(base)
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=2)
    with torch.no_grad(), mgr.batch(names):
        got = run(model)
    check_rows(got, want, plain, names, torch.float32)
