"""Background reads that hang, fail or can never fit: a read has a deadline and an abandoned read gives
back its place (its host reservation and its worker); a read that fails evicts no other adapter; a pin
that would leave a registered adapter no room in the host tier is refused; a serving loop can wait for
the next read instead of spinning.

A hung read is a read of an adapter that blocks on an ``Event`` (or, in the subprocess, on opening a
FIFO no one writes to) until the test lets it go: a stand-in for a hung network mount.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import AdapterLoadError, CapacityError, LoRAManager, LoRARef

TARGETS = ["q_proj", "v_proj"]
IDS = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def world(
    tiny_llama: torch.nn.Module, make_adapters: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, dict[str, Path]]:
    """The session's tiny Llama (copied per manager) and adapters a-d of rank 4."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {n: dict(r=4, lora_alpha=8, target_modules=TARGETS, seed=i + 1) for i, n in enumerate("abcd")}
    return tiny_llama, make_adapters(root, specs)


def manager(world: Any, **kwargs: Any) -> tuple[LoRAManager, Any]:
    base, _ = world
    model = copy.deepcopy(base)
    kwargs.setdefault("max_lora_rank", 4)
    kwargs.setdefault("lora_target_modules", TARGETS)
    return LoRAManager(model, **kwargs), model


def evicted_world(world: Any, **kwargs: Any) -> LoRAManager:
    """A manager whose host tier (two places) holds b and c, both in device slots: a was evicted."""
    _, paths = world
    mgr, _ = manager(world, max_loras_per_batch=2, max_loaded_loras=2, **kwargs)
    for name in "abc":
        mgr.load(name, paths[name])
    mgr.finish(mgr.prepare_step(["b", "c"], 1))
    assert places(mgr) == (["b", "c"], ["b", "c"])
    return mgr


def places(mgr: LoRAManager) -> tuple[list[str], list[str]]:
    stats = mgr.registry.stats()
    return sorted(stats["host"]["resident"]), sorted(stats["device"]["resident"])


def step(mgr: LoRAManager, names: list[str | None]) -> Any:
    got = mgr.prepare_step(names, 1)
    mgr.finish(got)
    return got


# ---- item 3: a failed read evicts no one ------------------------------------------------------------


def test_a_failed_background_read_evicts_no_other_adapter(world: Any, tmp_path: Path) -> None:
    """a's files broke after it left host memory; its background read fails. b and c, which the host
    tier would have evicted to make room for it, stay in both tiers: room is made only once a read has
    succeeded."""
    _, paths = world
    mgr, _ = manager(world, max_loras_per_batch=2, max_loaded_loras=2)
    shutil.copytree(paths["a"], tmp_path / "a")
    mgr.load("a", tmp_path / "a")
    for name in "bc":
        mgr.load(name, paths[name])
    step(mgr, ["b", "c"])
    before = places(mgr)
    assert before == (["b", "c"], ["b", "c"])
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    assert step(mgr, ["a"]).loading == (0,)
    assert places(mgr) == before, "the read's reservation evicted an adapter"
    assert mgr.wait_loads(timeout=20)
    got = step(mgr, ["a", None])
    assert list(got.failed) == [0] and isinstance(got.failed[0], AdapterLoadError)
    assert places(mgr) == before
    stats = mgr.stats()
    assert stats["host_bytes"] == stats["host"]["bytes"] and stats["host"]["reserved_bytes"] == 0
    mgr.registry.audit()


def test_a_read_that_succeeds_makes_its_room_when_it_is_installed(world: Any) -> None:
    """The counterpart: a's read succeeds, and the least recently used adapter leaves for it then."""
    mgr = evicted_world(world)
    step(mgr, ["c"])
    assert step(mgr, ["a"]).loading == (0,)
    assert places(mgr) == (["b", "c"], ["b", "c"])
    assert mgr.wait_loads(timeout=20)
    assert step(mgr, ["a"]).admitted == (0,)
    assert places(mgr)[0] == ["a", "c"]
    assert "b" not in mgr.host
    mgr.registry.audit()


# ---- item 5: every registered adapter fits beside the pinned ones -------------------------------------


def test_a_pin_that_would_leave_an_adapter_no_host_room_is_refused(world: Any) -> None:
    """Host memory for two and a half adapters: with b and c pinned, a could never enter it again and
    its requests would wait for ever, so pinning c is refused with the numbers, and a is served."""
    _, paths = world
    nbytes = manager(world, lora_paths=[f"a={paths['a']}"])[0].host["a"].nbytes
    mgr, _ = manager(world, max_loras_per_batch=3, max_host_bytes=nbytes * 5 // 2)
    for name in "abc":
        mgr.load(name, paths[name])  # c evicts a
    mgr.pin("b")
    with pytest.raises(CapacityError) as refused:
        mgr.pin("c")
    message = str(refused.value)
    assert '"a"' in message and f"max_host_bytes={nbytes * 5 // 2}" in message, message
    assert mgr.registry.stats()["pinned_names"] == ["b"]
    assert step(mgr, ["a"]).loading == (0,)
    assert mgr.wait_loads(timeout=20)
    assert step(mgr, ["a"]).admitted == (0,)
    # Nor may an adapter be registered that could never enter beside the pins.
    with pytest.raises(CapacityError, match="could never enter the host tier beside them"):
        mgr.registry.register(LoRARef.new("big", "/srv/big"), rank=4, host_bytes=2 * nbytes, device_bytes=1)
    mgr.registry.audit()
