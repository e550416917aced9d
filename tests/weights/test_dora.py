"""Reading PEFT DoRA adapters: magnitudes, factors against an fp64 reference, and every refusal.

The factor of each output feature is checked against ``m / ||W + s B A||`` computed in float64 from the
file's own tensors and the model's weight (PEFT's formula, ``peft/tuners/lora/dora.py``). Broken
adapters (a magnitude missing, misshapen or NaN, DoRA on an embedding or on MoE experts, magnitudes
without ``use_dora``) are refused with the adapter and the tensor or module named, and a host tier that
refused one holds what it held before.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import save_peft_adapter
from lora_pin.model.attach import base_weights, model_targets
from lora_pin.weights.config import AdapterConfig
from lora_pin.weights.host_tier import HostTier, load_adapter
from lora_pin.weights.reader import PEFT_PREFIX

Q0 = "model.layers.0.self_attn.q_proj"
MAG = f"{PEFT_PREFIX}{Q0}.lora_magnitude_vector"


def edited(
    source: Path,
    dest: Path,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
    config: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    dest.mkdir()
    state = load_file(str(source / "adapter_model.safetensors"))
    if tensors is not None:
        tensors(state)
    save_file(state, str(dest / "adapter_model.safetensors"))
    fields = json.loads((source / "adapter_config.json").read_text())
    if config is not None:
        config(fields)
    (dest / "adapter_config.json").write_text(json.dumps(fields))
    return dest


@pytest.fixture(scope="module")
def world(tiny_llama: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = copy.deepcopy(tiny_llama)
    targets, module_of = model_targets(model, None)
    root = tmp_path_factory.mktemp("dora-reading")
    dora = save_peft_adapter(
        tiny_llama,
        root / "dora",
        1,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        use_rslora=True,
        rank_pattern={"down_proj": 2},
        alpha_pattern={"v_proj": 3},
        use_dora=True,
    )
    return {
        "model": model,
        "targets": targets,
        "weights": base_weights(model, targets, module_of),
        "root": root,
        "dora": dora,
    }


def _load(world: dict[str, Any], path: Path, **kwargs: Any) -> Any:
    return load_adapter(
        path.name,
        path,
        world["targets"],
        max_rank=8,
        dtype=torch.float32,
        base_weights=world["weights"],
        **kwargs,
    )


def test_factors_equal_peft_formula_in_fp64(world: dict[str, Any]) -> None:
    adapter = _load(world, world["dora"])
    state = load_file(str(world["dora"] / "adapter_model.safetensors"))
    config = json.loads((world["dora"] / "adapter_config.json").read_text())
    assert adapter.dora and set(adapter.modules) == {
        f"model.layers.{i}.{m}"
        for i in (0, 1)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    for key, module in adapter.modules.items():
        prefix = f"{PEFT_PREFIX}{key}"
        a, b = state[f"{prefix}.lora_A.weight"].double(), state[f"{prefix}.lora_B.weight"].double()
        magnitude = state[f"{prefix}.lora_magnitude_vector"].double()
        rank = a.shape[0]
        alpha = config["alpha_pattern"].get(key.rpartition(".")[2], config["lora_alpha"])
        scaling = alpha / math.sqrt(rank)  # rsLoRA
        assert module.scalings[0] == pytest.approx(scaling)
        weight = world["model"].get_submodule(key).weight.detach().double()
        want = magnitude / torch.linalg.norm(weight + scaling * b @ a, dim=1)
        assert module.factor is not None and module.factor.dtype == torch.float32
        torch.testing.assert_close(module.factor.double(), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(module.factor, torch.ones_like(module.factor), atol=1e-2)
    assert adapter.nbytes == adapter.whole_nbytes
    # The magnitude and factor (float32 [out]) are host bytes too.
    ab = sum(m.a.nbytes + m.b.nbytes for m in adapter.modules.values())
    assert adapter.nbytes == ab + sum(8 * m.b.shape[0] for m in adapter.modules.values())


def test_magnitudes_change_the_digest(world: dict[str, Any], tmp_path: Path) -> None:
    def scale(state: dict[str, torch.Tensor]) -> None:
        state[MAG] = state[MAG] * 2

    first = _load(world, world["dora"])
    other = _load(world, edited(world["dora"], tmp_path / "scaled", scale))
    assert first.digest != other.digest
    assert _load(world, edited(world["dora"], tmp_path / "same")).digest == first.digest


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda state: state.pop(name)


def _put(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda state: state.__setitem__(name, value)


def _nan(state: dict[str, torch.Tensor]) -> None:
    state[MAG] = state[MAG].clone()
    state[MAG][3] = float("nan")


def _zero_b_row(state: dict[str, torch.Tensor]) -> None:
    b = f"{PEFT_PREFIX}{Q0}.lora_B.weight"
    state[b] = state[b].clone()
    state[b][5] = 0


REFUSALS: list[tuple[str, Any, Any, str]] = [
    ("missing", _drop(MAG), None, rf"field 'use_dora' is true \(DoRA\) but module '{Q0}' has no tensor"),
    ("short", _put(MAG, torch.ones(63)), None, r"lora_magnitude_vector' has shape \[63\], expected \[64\]"),
    ("matrix", _put(MAG, torch.ones(64, 1)), None, r"has shape \[64, 1\], expected \[64\]"),
    ("nan", _nan, None, r"lora_magnitude_vector' has 1 NaN/Inf value\(s\)"),
    (
        "not_dora",
        None,
        lambda c: c.update(use_dora=False),
        r"are DoRA magnitudes, but the config's field 'use_dora'",
    ),
    (
        "zero_norm",
        _zero_b_row,
        None,
        rf"module '{Q0}': output feature 5: the norm \|\|W \+ s B A\|\| is zero",
    ),
]


@pytest.mark.parametrize(("case", "tensors", "config", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_broken_dora_adapters_refused_and_tier_unchanged(
    world: dict[str, Any], tmp_path: Path, case: str, tensors: Any, config: Any, message: str
) -> None:
    weights = world["weights"]
    if case == "zero_norm":
        # Base row 5 and the adapter's B row 5 zero: W + s B A is zero there, PEFT would divide by zero.
        weight = world["model"].get_submodule(Q0).weight.detach().clone()
        weight[5] = 0
        weights = {**weights, Q0: lambda: weight}
    path = edited(world["dora"], tmp_path / case, tensors, config)
    tier = HostTier(world["targets"], max_rank=8, dtype=torch.float32, base_weights=weights)
    held = tier.load("held", world["dora"])
    before = (list(tier), tier.nbytes)
    with pytest.raises(AdapterLoadError, match=message) as caught:
        tier.load(case, path)
    assert repr(case) in str(caught.value)
    assert (list(tier), tier.nbytes) == before and tier["held"] is held


def test_dora_on_an_embedding_refused_by_name(
    world: dict[str, Any], tmp_path: Path, tiny_llama: torch.nn.Module
) -> None:
    from lora_pin.model.attach import model_targets
    from lora_pin.weights.targets import ModuleSelection

    model = copy.deepcopy(tiny_llama)
    targets, module_of = model_targets(model, ModuleSelection.of(["embed_tokens", "q_proj"]))
    path = save_peft_adapter(
        tiny_llama,
        tmp_path / "embed",
        2,
        r=4,
        lora_alpha=8,
        target_modules=["embed_tokens", "q_proj"],
        use_dora=True,
    )
    with pytest.raises(AdapterLoadError, match=r"DoRA on embedding 'model.embed_tokens' cannot be served"):
        load_adapter(
            "embed",
            path,
            targets,
            max_rank=8,
            dtype=torch.float32,
            base_weights=base_weights(model, targets, module_of),
        )


def test_dora_on_moe_experts_refused_by_name() -> None:
    fields = {"r": 4, "lora_alpha": 8, "target_parameters": ["mlp.experts.gate_up_proj"], "use_dora": True}
    with pytest.raises(
        AdapterLoadError, match=r"field 'use_dora' is true with target_parameters: DoRA on MoE"
    ):
        AdapterConfig.from_mapping("moe", "adapter_config.json", fields)


def test_dora_without_base_weights_cannot_fill_a_pool(world: dict[str, Any]) -> None:
    from lora_pin.errors import PoolError
    from lora_pin.weights.pool import DevicePool

    adapter = load_adapter("bare", world["dora"], world["targets"], max_rank=8, dtype=torch.float32)
    pool = DevicePool(world["targets"], 2, 8, torch.float32)
    with pytest.raises(PoolError, match=r"DoRA adapter read without the model's base weights"):
        pool.fill(0, adapter)
    assert pool.occupant(0) is None
