"""``lora-pin inspect`` on PEFT adapters over ``lm_head`` and ``embed_tokens``: reported servable, as
``LoRAManager`` serves them, PEFT's copies of the base weights checked against the model's checkpoint, and
device bytes in the model's dtype. PEFT's own ``save_pretrained`` writes the adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin.cli import main
from lora_pin.fixtures import save_peft_adapter

SPECS: dict[str, dict[str, Any]] = {
    "head": {"r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]},
    "embed": {"r": 2, "lora_alpha": 3, "target_modules": ["embed_tokens"]},
    "both": {"r": 3, "lora_alpha": 6, "target_modules": ["embed_tokens", "lm_head", "q_proj"]},
}


@pytest.fixture(scope="module", params=["untied", "tied"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=request.param == "tied",
    )
    model = LlamaForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("heads")
    model.save_pretrained(root / "base")
    adapters = {n: save_peft_adapter(model, root / n, i + 1, **s) for i, (n, s) in enumerate(SPECS.items())}
    return model, root / "base", adapters


def inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def field(out: str, name: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(f"{name}:")]
    return line.partition(":")[2].strip()


@pytest.mark.parametrize("name", list(SPECS))
def test_adapters_on_lm_head_and_embeddings_are_servable_with_model_dtype_bytes(
    world: Any, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    from lora_pin import LoRAManager

    model, base, adapters = world
    code, out, err = inspect(capsys, str(adapters[name]))
    assert (code, err) == (0, "")
    assert "(PEFT's; checked against the model when served)" in field(out, "base copies")
    code, out, err = inspect(capsys, str(adapters[name]), "--model", str(base))
    assert (code, err) == (0, ""), err
    assert field(out, "base copies").endswith("(PEFT's; equal to the model's)")
    tensors = load_file(adapters[name] / "adapter_model.safetensors")
    lora = sum(t.numel() for k, t in tensors.items() if ".lora_" in k)
    assert field(out, "device bytes") == f"{lora * 4} (float32)"  # the model is float32
    # What inspect calls servable, the manager serves.
    LoRAManager(model, [f"{name}={adapters[name]}"]).detach()


def test_a_base_copy_that_differs_from_the_models_weight_is_refused_with_model(
    world: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _, base, adapters = world
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "adapter_config.json").write_text((adapters["head"] / "adapter_config.json").read_text())
    tensors = load_file(adapters["head"] / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.base_layer.weight"] += 1.0
    save_file(tensors, changed / "adapter_model.safetensors")
    code, _, err = inspect(capsys, str(changed), "--model", str(base))
    assert code == 2
    assert "PEFT's copy of module 'lm_head''s base weight, differs from the model's" in err


def test_an_explicit_dtype_still_sets_the_device_bytes(
    world: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _, base, adapters = world
    code, out, _ = inspect(capsys, str(adapters["head"]), "--model", str(base), "--dtype", "bfloat16")
    tensors = load_file(adapters["head"] / "adapter_model.safetensors")
    lora = sum(t.numel() for k, t in tensors.items() if ".lora_" in k)
    assert code == 0 and field(out, "device bytes") == f"{lora * 2} (bfloat16)"
