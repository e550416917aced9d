"""The tier holders on their own, over a small core: :class:`Residency` (the tensors behind both tiers)
and :class:`BackgroundReads` (the installer of background reads), without a manager or a model forward.

Oracles: the weights PEFT saved (read back with safetensors), and the core's own audit and placement.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lora_pin import LoRARef, LoRARegistry
from lora_pin.errors import AdapterLoadError
from lora_pin.model.attach import model_targets
from lora_pin.model.reads import BackgroundReads
from lora_pin.model.residency import Residency
from lora_pin.parallel import SingleProcess
from lora_pin.weights import DevicePool, HostTier
from lora_pin.weights.targets import ModuleSelection

TARGETS = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def adapters(make_adapters: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    specs = {n: dict(r=4, lora_alpha=8, target_modules=list(TARGETS), seed=i) for i, n in enumerate("abc", 1)}
    return make_adapters(tmp_path_factory.mktemp("holders"), specs)


def holder(tiny_llama: torch.nn.Module, slots: int = 2, host: int | None = None) -> Residency:
    targets, _ = model_targets(tiny_llama, ModuleSelection.of(TARGETS, TARGETS))
    registry = LoRARegistry(slots, host)
    tier = HostTier(targets, max_rank=4, dtype=torch.float32)
    return Residency(registry, tier, DevicePool(targets, slots, 4, torch.float32))


def tier_of(residency: Residency, name: str) -> str:
    return next(entry[3] for entry in residency.registry.placement()["adapters"] if entry[0] == name)


def saved_a(folder: Path, module: str) -> torch.Tensor:
    """The ``lora_A`` PEFT saved for the first layer's ``module``."""
    weights = load_file(str(folder / "adapter_model.safetensors"))
    return next(t for k, t in weights.items() if f"layers.0.self_attn.{module}.lora_A" in k)


def test_a_planned_load_puts_the_saved_weights_in_its_slot(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    residency = holder(tiny_llama)
    residency.add(LoRARef.new("a", str(adapters["a"])))
    plan = residency.registry.begin_step(["a"], 1)
    assert plan.ticket is not None
    writes = residency.apply(plan)
    [(slot, _)] = writes
    assert residency.pool.occupant(slot) == "a"
    a_buffer = residency.pool.buffers("model.layers.0.self_attn.q_proj")[0]
    torch.testing.assert_close(a_buffer[slot, :4], saved_a(adapters["a"], "q_proj"))
    assert residency.changed_slots(writes) == []
    residency.registry.finish_step(plan.ticket)
    residency.registry.audit()


def test_host_evictions_free_the_tensors_and_are_counted(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    residency = holder(tiny_llama, host=2)
    for name in "abc":
        residency.add(LoRARef.new(name, str(adapters[name])))
    # A host tier of two: registering c evicted the least recently used, a.
    assert "a" not in residency.host and "b" in residency.host and "c" in residency.host
    assert residency.evictions[("a", "host")] == 1
    assert tier_of(residency, "a") == "disk"
    residency.registry.audit()


def test_installs_enter_a_background_read_and_keep_a_failure_for_its_requests(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path], tmp_path: Path
) -> None:
    residency = holder(tiny_llama, host=2)
    broken = tmp_path / "b"
    shutil.copytree(adapters["b"], broken)
    residency.add(LoRARef.new("a", str(adapters["a"])))
    residency.add(LoRARef.new("b", str(broken)))
    residency.add(LoRARef.new("c", str(adapters["c"])))  # evicts a
    loads = BackgroundReads(residency, SingleProcess(), workers=1)
    try:
        assert loads.start_fetches(residency.registry.prefetch(["a"]).to_fetch) == ["a"]
        assert tier_of(residency, "a") == "fetching"
        assert loads.wait(timeout=30)
        loads.install()
        # Its room came from the least recently used idle adapter, b.
        assert tier_of(residency, "a") == "host" and "a" in residency.host and "b" not in residency.host
        assert residency.background_loads == 1
        # b's file is gone now: its read fails, and the failure waits for b's requests.
        (broken / "adapter_model.safetensors").unlink()
        assert loads.start_fetches(residency.registry.prefetch(["b"]).to_fetch) == ["b"]
        assert loads.wait(timeout=30)
        loads.install()
        assert tier_of(residency, "b") == "disk" and loads.failed_names() == ["b"]
        error = loads.take_errors(["b"])["b"]
        assert isinstance(error, AdapterLoadError) and "b" in str(error)
        assert loads.take_errors(["b"]) == {} and loads.failures == 1
        residency.registry.audit()
    finally:
        loads.close()


def test_a_read_of_replaced_weights_is_not_installed(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    residency = holder(tiny_llama, host=2)
    for name in "abc":
        residency.add(LoRARef.new(name, str(adapters[name])))  # c evicts a
    [(name, serial)] = residency.registry.prefetch(["a"]).to_fetch
    old = residency.read_fetch(name, serial)
    residency.replace("a", residency.read_new("a", str(adapters["c"]), None), str(adapters["c"]), None, None)
    assert residency.install_fetch("a", serial, old) is False
    # The replacement's weights are served; the read of the old ones changed nothing.
    assert residency.host["a"].digest != old.digest
    assert residency.identity("a")[2] == 2
    residency.registry.audit()
