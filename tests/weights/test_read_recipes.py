"""Loads of adapters trained alike (the same config and header bytes) reuse what the first load decided:
each such load must give exactly what a first load of the same files gives, and refuse what it refuses."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lora_pin.weights.host_tier as host
from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import make_peft_adapter
from lora_pin.weights import HostAdapter, LoRATargets, load_adapter
from lora_pin.weights.shards import ShardPlan

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEY = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"


@pytest.fixture(scope="module")
def alike(
    tmp_path_factory: pytest.TempPathFactory, make_adapters: Callable[..., dict[str, Path]]
) -> list[Path]:
    """Three adapters of one recipe (one config, one header), different weights."""
    root = tmp_path_factory.mktemp("plans")
    specs = {f"a{i}": dict(r=4, lora_alpha=8, target_modules=ALL, seed=30 + i) for i in range(3)}
    made = make_adapters(root, specs)
    return [made[f"a{i}"] for i in range(3)]


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The adapters whose load ran the checks against the model (a load by a plan does not)."""
    seen: list[str] = []
    original = host._check_against_model

    def counted(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(file.name)
        return original(file, *args, **kwargs)

    monkeypatch.setattr(host, "_check_against_model", counted)
    return seen


def set_element(path: Path, key: str, index: int, value: float) -> None:
    """Overwrite float32 element ``index`` of tensor ``key`` in place (the header stays as it was)."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    begin = json.loads(raw[8 : 8 + length])[key]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(8 + length + begin + 4 * index)
        f.write(struct.pack("<f", value))


def load(name: str, path: Path, targets: LoRATargets) -> HostAdapter:
    return load_adapter(name, path, targets, max_rank=8, dtype=torch.float32, pin_memory=False)


def assert_same(planned: HostAdapter, first: HostAdapter) -> None:
    assert planned.digest == first.digest
    assert (planned.nbytes, planned.whole_nbytes, planned.tensors_applied) == (
        first.nbytes,
        first.whole_nbytes,
        first.tensors_applied,
    )
    assert planned.modules.keys() == first.modules.keys()
    for key, module in planned.modules.items():
        want = first.modules[key]
        assert module.group == want.group and module.ranks == want.ranks and module.scalings == want.scalings
        for got, expected in (
            (module.a, want.a),
            (module.b, want.b),
            (module.rank_tensor, want.rank_tensor),
            (module.scaling_tensor, want.scaling_tensor),
        ):
            assert got.dtype == expected.dtype and torch.equal(got, expected), key


def test_a_load_by_a_plan_equals_a_first_load(
    alike: list[Path], tiny_llama: torch.nn.Module, checks: list[str]
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    load("first", alike[0], targets)
    planned = [load(f"p{i}", path, targets) for i, path in enumerate(alike)]
    assert checks == ["first"], "the later loads of the same recipe must reuse the first one's plan"
    for i, path in enumerate(alike):
        # A fresh description of the same model has no plans: its loads decide everything again.
        first = load(f"p{i}", path, LoRATargets.from_model(tiny_llama))
        assert_same(planned[i], first)
        stored = load_file(path / "adapter_model.safetensors")
        group = planned[i].modules["model.layers.1.self_attn.qkv_proj"]
        assert torch.equal(group.a[8:12], stored[KEY]), "v_proj's A is the file's"
    assert len({p.digest for p in planned}) == 3
    # Each adapter owns its memory: no two share a slab.
    slabs = {m.a.untyped_storage().data_ptr() for p in planned for m in p.modules.values()}
    assert len(slabs) == 3


def test_a_load_by_a_plan_refuses_a_nan_as_a_first_load_does(
    alike: list[Path], tiny_llama: torch.nn.Module, tmp_path: Path, checks: list[str]
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    load("first", alike[0], targets)
    broken = tmp_path / "nan"
    shutil.copytree(alike[1], broken)
    set_element(broken / "adapter_model.safetensors", KEY, 1 * 64 + 2, float("nan"))
    with pytest.raises(AdapterLoadError) as planned:
        load("broken", broken, targets)
    assert checks == ["first"]
    with pytest.raises(AdapterLoadError) as first:
        load("broken", broken, LoRATargets.from_model(tiny_llama))
    assert str(planned.value) == str(first.value)
    assert repr(KEY) in str(planned.value) and "1 NaN/Inf" in str(planned.value)


def test_another_config_with_the_same_header_is_decided_again(
    alike: list[Path], tiny_llama: torch.nn.Module, tmp_path: Path, checks: list[str]
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    before = load("first", alike[0], targets)
    other = tmp_path / "alpha"
    shutil.copytree(alike[0], other)
    fields = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**fields, "lora_alpha": 12}))
    after = load("alpha", other, targets)
    assert checks == ["first", "alpha"]
    assert all(s == 3.0 for m in after.modules.values() for s in m.scalings)
    assert all(s == 2.0 for m in before.modules.values() for s in m.scalings)
    assert after.digest != before.digest
    # The same bytes with the config refused: nothing decided for the good one serves it.
    (other / "adapter_config.json").write_text(json.dumps({**fields, "r": 2}))
    with pytest.raises(AdapterLoadError, match="rank 4 but field 'r'"):
        load("alpha", other, targets)


def test_a_header_indexed_before_does_not_excuse_trailing_bytes(
    alike: list[Path], tiny_llama: torch.nn.Module, tmp_path: Path
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    load("first", alike[0], targets)
    padded = tmp_path / "padded"
    shutil.copytree(alike[0], padded)
    with open(padded / "adapter_model.safetensors", "ab") as f:
        f.write(bytes(16))
    with pytest.raises(AdapterLoadError, match="tensors cover"):
        load("padded", padded, targets)


def test_threads_loading_by_one_plan_get_their_own_adapters(
    alike: list[Path], tiny_llama: torch.nn.Module
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    fresh = [load(f"f{i}", path, LoRATargets.from_model(tiny_llama)) for i, path in enumerate(alike)]
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda i: load(f"t{i}", alike[i % 3], targets), range(24)))
    for i, adapter in enumerate(loaded):
        assert_same(adapter, fresh[i % 3])


def built(name: str, path: Path, targets: LoRATargets) -> HostAdapter:
    """``path`` loaded without a plan: a plan over ranks that cuts nothing holds every tensor whole, as one
    process does, and has its host modules built one by one (ranks never share plans)."""
    return load_adapter(
        name,
        path,
        targets,
        max_rank=8,
        dtype=torch.float32,
        pin_memory=False,
        shards=ShardPlan(parallel=True),
    )


def test_a_first_load_by_the_plan_it_decides_equals_a_load_built_module_by_module(
    alike: list[Path], tiny_llama: torch.nn.Module, tmp_path: Path
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    first = load("a", alike[0], targets)
    assert len(host._recipes(targets)._held) == 1, "a plain first load decides a plan"
    assert_same(first, built("a", alike[0], LoRATargets.from_model(tiny_llama)))
    # A rank pattern pads v_proj's slice of the fused qkv group: no plan, built, and still PEFT's tensors.
    padded = tmp_path / "pattern"
    made = make_peft_adapter(
        tiny_llama, padded, r=4, lora_alpha=8, target_modules=ALL, rank_pattern={"v_proj": 2}
    )
    fresh = LoRATargets.from_model(tiny_llama)
    pattern = load("pattern", made, fresh)
    assert len(host._recipes(fresh)._held) == 0
    assert_same(pattern, built("pattern", made, LoRATargets.from_model(tiny_llama)))
    stored = load_file(made / "adapter_model.safetensors")
    assert torch.equal(pattern.modules["model.layers.1.self_attn.qkv_proj"].a[8:10], stored[KEY])
    # A NaN is refused in the same words either way.
    broken = tmp_path / "nan"
    shutil.copytree(alike[1], broken)
    set_element(broken / "adapter_model.safetensors", KEY, 3, float("inf"))
    with pytest.raises(AdapterLoadError) as planned:
        load("broken", broken, LoRATargets.from_model(tiny_llama))
    with pytest.raises(AdapterLoadError) as whole:
        built("broken", broken, LoRATargets.from_model(tiny_llama))
    assert str(planned.value) == str(whole.value) and "1 NaN/Inf" in str(planned.value)
