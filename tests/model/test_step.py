"""A step whose arrays are the last step's gets the last step's tensors (``StepArrays``): the same objects
when the core hands the same bytes, fresh ones with the new contents otherwise, and a slot refilled by
another adapter between two such steps serves the new adapter (against an fp64 reference from its files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from lora_pin import LoRAManager
from lora_pin.ops import segments_from_slots

MODULE = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def adapters(make_adapters: Any, tmp_path: Path) -> dict[str, Path]:
    # Different ranks: a plan made for one slot's rank would be wrong for the other's.
    return make_adapters(
        tmp_path,
        {
            "a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "seed": 1},
            "b": {"r": 2, "lora_alpha": 8, "target_modules": ["q_proj"], "seed": 2},
        },
    )


def _manager(tiny_llama_dir: Path, adapters: dict[str, Path], slots: int) -> LoRAManager:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    return LoRAManager(model, [f"{n}={d}" for n, d in adapters.items()], max_loras_per_batch=slots)


def _delta(folder: Path, rank: int, x: torch.Tensor) -> torch.Tensor:
    """``scaling * B (A x)`` of the adapter in ``folder`` for ``MODULE``, in fp64."""
    weights = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    a = weights[f"base_model.model.{MODULE}.lora_A.weight"].double()
    b = weights[f"base_model.model.{MODULE}.lora_B.weight"].double()
    return (x.double() @ a.T @ b.T) * (8 / rank)


def _slots(manager: LoRAManager, names: list[str | None]) -> list[int]:
    """Each request's slot as the registry places its adapter (-1: base model)."""
    where = {a[0]: a[4] for a in manager.registry.placement()["adapters"]}
    return [-1 if n is None else where[n] for n in names]


def test_the_same_arrays_give_the_same_tensors_and_new_ones_new_tensors(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    manager = _manager(tiny_llama_dir, adapters, slots=2)
    names: list[str | None] = ["a", None, "b", "a"]
    manager.finish(manager.prepare_step(names, 1))  # loads both into slots
    first = manager.prepare_step(names, 1)
    manager.finish(first)
    again = manager.prepare_step(names, 1)
    manager.finish(again)
    assert again.request_slots is first.request_slots
    assert again.segments is first.segments
    other: list[str | None] = ["b", "a", None, "b"]
    changed = manager.prepare_step(other, 1)
    manager.finish(changed)
    assert changed.request_slots is not first.request_slots
    slots = _slots(manager, other)
    assert changed.request_slots.tolist() == slots
    want = segments_from_slots(torch.tensor(slots))
    for got, expected in zip(changed.segments[:3], want[:3], strict=True):
        assert torch.equal(got, expected)


def test_a_write_into_a_steps_tensor_ends_the_reuse(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    manager = _manager(tiny_llama_dir, adapters, slots=2)
    names: list[str | None] = ["a", "b", None]
    manager.finish(manager.prepare_step(names, 1))
    step = manager.prepare_step(names, 1)
    manager.finish(step)
    step.request_slots.fill_(7)
    nxt = manager.prepare_step(names, 1)
    manager.finish(nxt)
    assert nxt.request_slots is not step.request_slots
    assert nxt.request_slots.tolist() == _slots(manager, names)


def test_a_slot_refilled_between_steps_of_the_same_arrays_serves_its_new_adapter(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    manager = _manager(tiny_llama_dir, adapters, slots=1)
    layer = manager.model.get_submodule(MODULE)
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(0))
    steps = []
    for name, rank in [("a", 4), ("b", 2), ("a", 4)]:
        # One slot: each step evicts the other adapter, and its arrays are byte for byte the last one's.
        step = manager.prepare_step([name, name], 1)
        steps.append(step)
        with torch.no_grad():
            out = layer(x).double()
            base = layer.base_layer(x).double()
        manager.finish(step)
        torch.testing.assert_close(out, base + _delta(adapters[name], rank, x), rtol=1e-5, atol=1e-5)
    assert steps[1].segments is steps[0].segments and steps[2].segments is steps[0].segments
