"""End to end against PEFT as the oracle: mixed batches through LoRAManager equal PEFT's
``model(..., adapter_names=[...])``, through evictions, pins, unload/reload and detach."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import lora_pin
from lora_pin import (
    AdapterLoadError,
    AdapterNotFoundError,
    CapacityError,
    LoRAManager,
    PathNotAllowedError,
    SpecError,
)
from lora_pin.fixtures import make_peft_adapter
from lora_pin.ops import CUDA_CHUNK_SIZE

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120
# Six adapters: mixed ranks, rslora, rank/alpha patterns, partial target modules, a subset of layers.
ADAPTERS: dict[str, dict[str, Any]] = {
    "a8": dict(r=8, lora_alpha=16, target_modules=ATTN + MLP, seed=1),
    "rs16": dict(r=16, lora_alpha=8, target_modules=ATTN, use_rslora=True, seed=2),
    "pat": dict(
        r=8,
        lora_alpha=16,
        target_modules=ATTN + MLP,
        rank_pattern={"q_proj": 2, "down_proj": 16},
        alpha_pattern={"v_proj": 3},
        seed=3,
    ),
    "mlp4": dict(r=4, lora_alpha=4, target_modules=MLP, seed=4),
    "qv2": dict(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=5),
    "layer1": dict(r=16, lora_alpha=16, target_modules=ATTN + MLP, layers_to_transform=[1], seed=6),
}


@dataclass
class World:
    base_dir: Path
    adapters: dict[str, Path]
    peft: Any
    base: Any


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: Path,
    make_adapters: Callable[..., dict[str, Path]],
) -> World:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("e2e")
    base_dir = tiny_llama_dir
    adapters = make_adapters(root, ADAPTERS)
    names = list(adapters)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), adapters[names[0]], adapter_name=names[0]
    )
    for n in names[1:]:
        peft.load_adapter(adapters[n], adapter_name=n)
    peft.eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    return World(base_dir, adapters, peft, base)


def fresh_model(world: World) -> torch.nn.Module:
    return copy.deepcopy(world.base)


def oracle(world: World, ids: torch.Tensor, names: list[str | None]) -> torch.Tensor:
    with torch.no_grad():
        return world.peft(ids, adapter_names=[n or "__base__" for n in names]).logits


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def items(world: World, pinned: tuple[str, ...] = ()) -> list[Any]:
    return [
        {"lora_name": n, "lora_path": str(p), "pinned": True} if n in pinned else f"{n}={p}"
        for n, p in world.adapters.items()
    ]


def test_mixed_batch_equals_peft_and_base_rows_equal_base(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world), max_loras_per_batch=6)
    names: list[str | None] = ["a8", None, "rs16", "pat", "mlp4", None, "qv2", "layer1", "a8"]
    ids = tokens(len(names), 7, 0)
    with torch.no_grad(), mgr.batch(names):
        got = model(ids).logits
    assert_close(got, oracle(world, ids, names))
    with torch.no_grad():
        base = world.base(ids).logits
    for i, n in enumerate(names):
        if n is None:
            assert torch.equal(got[i], base[i]), "a base-model row was touched"
    assert not torch.equal(got[0], base[0]), "adapters changed nothing: the test would prove nothing"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_is_chunked_and_equals_peft(world: World) -> None:
    # On CUDA the Triton kernels run, and long segments are cut into CUDA_CHUNK_SIZE chunks.
    model = fresh_model(world).cuda()
    mgr = LoRAManager(model, items(world), max_loras_per_batch=6)
    assert mgr.chunk_size == CUDA_CHUNK_SIZE
    names: list[str | None] = ["a8", None, "rs16", "pat", "a8"]
    ids = tokens(len(names), 150, 1)  # segments of 150 and 300 tokens: several chunks each
    with torch.no_grad(), mgr.batch(names):
        got = model(ids.cuda()).logits.cpu()
    torch.testing.assert_close(got, oracle(world, ids, names), rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_of_resident_adapters_make_no_host_device_sync(world: World) -> None:
    # The planner's arrays go up from pinned memory without blocking, so the host can plan step N+1
    # while the GPU still runs step N.
    model = fresh_model(world).cuda()
    mgr = LoRAManager(model, items(world), max_loras_per_batch=6)
    names: list[str | None] = ["a8", None, "rs16", "pat", "a8"]
    mgr.finish(mgr.prepare_step(names, [3, 1, 2, 5, 1]))  # loads every adapter once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = mgr.prepare_step(names, [2, 4, 1, 1, 3])
        mgr.finish(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fewer_slots_than_adapters_evicts_between_steps(world: World) -> None:
    model = fresh_model(world)
    startup = items(world)[:3]
    mgr = LoRAManager(model, startup, max_loras_per_batch=2, max_loaded_loras=3)
    for name in list(world.adapters)[3:]:
        mgr.load(name, world.adapters[name])  # evicts from the host tier; reloaded from disk on demand
    rounds: list[list[str | None]] = [
        ["a8", "rs16", None],
        ["pat", None, "mlp4"],
        ["qv2", "layer1"],
        ["a8", "pat", "a8"],
        ["rs16", "qv2", None, "rs16"],
    ]
    for seed, names in enumerate(rounds):
        ids = tokens(len(names), 5, seed)
        with torch.no_grad(), mgr.batch(names):
            got = model(ids).logits
        assert_close(got, oracle(world, ids, names))
    stats = mgr.stats()
    assert stats["device"]["evictions"] > 0 and stats["host"]["evictions"] > 0, stats


def test_pinned_adapters_stay_and_batches_split(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world, pinned=("a8",)), max_loras_per_batch=2)
    names: list[str | None] = ["rs16", "a8", "pat", None, "qv2", "a8"]
    with pytest.raises(CapacityError, match="split"), mgr.batch(names):
        pass
    groups = mgr.split(names)
    assert [i for g in groups for i in g] == list(range(len(names))) and len(groups) == 3
    for seed, group in enumerate(groups):
        sub = [names[i] for i in group]
        ids = tokens(len(sub), 4, 10 + seed)
        with torch.no_grad(), mgr.batch(sub):
            got = model(ids).logits
        assert_close(got, oracle(world, ids, sub))
    stats = mgr.stats()
    assert stats["device"]["pinned"] == ["a8"] and "a8" in stats["device"]["resident"]
    assert stats["device"]["evictions"] > 0
    assert not any(key.startswith("a8/") for key in stats["evictions_by_adapter"]), stats


def test_a_finished_steps_adapters_can_be_evicted_by_a_load_between_steps(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world)[:2], max_loras_per_batch=2, max_loaded_loras=2)
    with torch.no_grad(), mgr.batch(["a8", "rs16"]):
        model(tokens(2, 2, 26))
    mgr.load("pat", world.adapters["pat"])  # the host tier is full of the finished step's adapters
    assert "pat" in mgr.host and len(mgr.host) == 2
    mgr.registry.audit()


def test_prepare_step_packs_tokens_and_defers(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world), max_loras_per_batch=2)
    names: list[str | None] = ["a8", None, "rs16", "pat"]
    step = mgr.prepare_step(names, [3, 2, 4, 5])
    try:
        assert step.admitted == (0, 1, 2) and step.deferred == (3,)
        assert step.num_tokens == 9
    finally:
        mgr.finish(step)


def test_unload_reload_and_detach(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world), max_loras_per_batch=3)
    names: list[str | None] = ["pat", "qv2", None]
    ids = tokens(3, 6, 3)
    assert "pat" in mgr and "qv2" in mgr and "nobody" not in mgr and None not in mgr and 5 not in mgr
    mgr.unload("pat")
    assert "pat" not in mgr  # what the serve engine asks before it plans a waiting request
    mgr.unload("pat")  # idempotent
    with pytest.raises(AdapterNotFoundError), mgr.batch(names):
        pass
    mgr.load("pat", world.adapters["pat"])
    assert "pat" in mgr
    with torch.no_grad(), mgr.batch(names):
        got = model(ids).logits
    assert_close(got, oracle(world, ids, names))
    asyncio.run(mgr.unload_async("qv2"))
    mgr.detach()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, world.base(ids).logits)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), world.base.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)


def discovering(world: World, adapter_dir: Path, **kwargs: Any) -> tuple[torch.nn.Module, LoRAManager]:
    model = fresh_model(world)
    options: dict[str, Any] = {"max_loras_per_batch": 4, "max_lora_rank": 16, **kwargs}
    mgr = LoRAManager(model, None, lora_target_modules=ATTN + MLP, adapter_dir=adapter_dir, **options)
    return model, mgr


def adapter_folder(world: World, tmp_path: Path, *names: str) -> Path:
    """A folder holding copies of the world's adapters ``names``, as an ``adapter_dir``."""
    root = tmp_path / "adapters"
    root.mkdir()
    for name in names:
        shutil.copytree(world.adapters[name], root / name)
    return root


def test_adapters_are_discovered_on_first_use(world: World, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    (root / "team").mkdir(parents=True)
    shutil.copytree(world.adapters["a8"], root / "a8")
    shutil.copytree(world.adapters["pat"], root / "team" / "pat")
    model, mgr = discovering(world, root)
    assert len(mgr.registry) == 0
    names: list[str | None] = ["a8", None, "team/pat", "a8"]
    ids = tokens(len(names), 5, 21)
    with torch.no_grad(), mgr.batch(names):
        got = model(ids).logits
    assert_close(got, oracle(world, ids, ["a8", None, "pat", "a8"]))
    assert sorted(mgr.stats()["host"]["resident"]) == ["a8", "team/pat"]
    assert mgr.discover(["a8", "team/pat", None]) == []  # registered now: nothing to do


def test_discovery_refuses_unknown_and_escaping_names_and_changes_nothing(
    world: World, tmp_path: Path
) -> None:
    root = adapter_folder(world, tmp_path, "a8")
    (root / "link").symlink_to(world.adapters["rs16"], target_is_directory=True)  # points out of root
    _, mgr = discovering(world, root)
    with pytest.raises(AdapterNotFoundError, match="missing"), mgr.batch(["a8", "missing"]):
        pass
    for bad in ["../a8", "/etc", "a8/../a8", "", "a\\b", "./a8", "a8/"]:
        with pytest.raises(PathNotAllowedError, match="folder name"):
            mgr.discover(["a8", bad])
    with pytest.raises(PathNotAllowedError, match="outside"):
        mgr.split(["a8", "link"])
    assert len(mgr.registry) == 0 and len(mgr.host) == 0, "a refused name left an adapter behind"
    # Without adapter_dir, an unknown name is still just unknown.
    plain = LoRAManager(fresh_model(world), items(world)[:1], max_loras_per_batch=2)
    with pytest.raises(AdapterNotFoundError, match="rs16"):
        plain.discover(["a8", "rs16"])


def test_discovery_is_all_or_nothing(world: World, tmp_path: Path) -> None:
    root = adapter_folder(world, tmp_path, "a8")
    shutil.copytree(world.adapters["rs16"], root / "broken")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    model, mgr = discovering(world, root)
    with pytest.raises(AdapterLoadError, match="broken"), mgr.batch(["a8", "broken"]):
        pass
    assert "a8" not in mgr.registry and len(mgr.host) == 0
    with torch.no_grad(), mgr.batch(["a8"]):  # and the manager still serves
        got = model(tokens(1, 3, 22)).logits
    assert_close(got, oracle(world, tokens(1, 3, 22), ["a8"]))


def test_a_failed_discovery_keeps_an_adapter_a_step_took_up_meanwhile(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = adapter_folder(world, tmp_path, "a8")
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{")
    model, mgr = discovering(world, root)
    real_read, reading_broken, step_running = mgr.host.read, threading.Event(), threading.Event()

    def read(name: str, path: Any, root: Any = None) -> Any:
        if name == "broken":
            reading_broken.set()
            assert step_running.wait(HANG_GUARD_S)  # a step on the other thread uses "a8" by now
        return real_read(name, path, root=root)

    monkeypatch.setattr(mgr.host, "read", read)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        failed = pool.submit(mgr.discover, ["a8", "broken"])
        # Names are read and registered in order: "a8" is registered once "broken" is being read.
        assert reading_broken.wait(HANG_GUARD_S)
        assert "a8" in mgr.registry
        step = mgr.prepare_step(["a8"], 3)
        step_running.set()
        with pytest.raises(AdapterLoadError, match="broken"):
            failed.result()
    # The rollback left "a8" alone: the running step's weights are intact and it finishes cleanly.
    assert "a8" in mgr.registry and "a8" in mgr.host
    ids = tokens(1, 3, 27)
    with torch.no_grad():
        got = model(ids).logits
    mgr.finish(step)
    assert_close(got, oracle(world, ids, ["a8"]))
    mgr.registry.audit()


def test_a_name_being_unloaded_is_not_found_again(world: World, tmp_path: Path) -> None:
    _, mgr = discovering(world, adapter_folder(world, tmp_path, "a8"), loading="blocking")
    step = mgr.prepare_step(iter(["a8", None]), 1)  # an iterator of names is read once, as a list
    assert step.admitted == (0, 1)
    with pytest.raises(lora_pin.UnloadTimeoutError):
        mgr.unload("a8", timeout=0)
    with pytest.raises(AdapterNotFoundError, match="being unloaded"):
        mgr.discover(["a8"])
    mgr.finish(step)
    mgr.unload("a8")
    assert mgr.discover(["a8"]) == ["a8"]


def test_a_discovered_adapter_stays_confined_when_read_again(world: World, tmp_path: Path) -> None:
    root = adapter_folder(world, tmp_path, "a8", "rs16", "qv2")
    model, mgr = discovering(world, root, max_loras_per_batch=1, max_loaded_loras=2)
    for name in ("a8", "rs16", "qv2"):  # the host tier keeps two: a8 is evicted, read again on use
        with torch.no_grad(), mgr.batch([name]):
            model(tokens(1, 2, 23))
    assert "a8" not in mgr.host
    shutil.rmtree(root / "a8")
    (root / "a8").symlink_to(world.adapters["a8"], target_is_directory=True)  # swapped for an escape
    with pytest.raises(PathNotAllowedError, match="outside"), mgr.batch(["a8"]):
        pass


def test_threads_discovering_one_adapter_load_it_once(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, mgr = discovering(world, adapter_folder(world, tmp_path, "a8"))
    # Both threads are made to be inside the (real) file read at once: the race, every time.
    import lora_pin.weights.host_tier as host_module

    real_load, both_reading = host_module.load_adapter, threading.Barrier(2, timeout=HANG_GUARD_S)

    def load_together(*args: Any, **kwargs: Any) -> Any:
        both_reading.wait()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(host_module, "load_adapter", load_together)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(mgr.discover, ["a8"]) for _ in range(2)]
        results = [f.result() for f in futures]
    assert sorted(map(len, results)) == [0, 1], results
    assert "a8" in mgr.host and "a8" in mgr.registry, "the losing thread dropped the winner's weights"
    mgr.registry.audit()
    assert mgr.stats()["host_bytes"] == mgr.host["a8"].nbytes
    monkeypatch.undo()
    ids = tokens(1, 3, 24)
    with torch.no_grad(), mgr.batch(["a8"]):
        got = model(ids).logits
    assert_close(got, oracle(world, ids, ["a8"]))
    assert mgr.stats()["host"]["loads"] == 1, "the adapter was read from disk again"


def test_a_startup_config_linked_out_of_the_roots_is_refused_before_it_is_read(
    world: World, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(world.adapters["a8"], root / "a8")
    secret = tmp_path / "secret.json"
    secret.write_text('{"r": "s3cr3t-outside-the-root"}')
    (root / "a8" / "adapter_config.json").unlink()
    (root / "a8" / "adapter_config.json").symlink_to(secret)
    with pytest.raises(PathNotAllowedError, match="outside every allowed root") as info:
        LoRAManager(fresh_model(world), [f"a8={root / 'a8'}"], max_loras_per_batch=2, allowed_roots=[root])
    assert "s3cr3t" not in str(info.value)


def test_adapter_dir_must_be_a_folder_inside_allowed_roots(world: World, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not a directory"):
        discovering(world, tmp_path / "nope")
    (tmp_path / "inside").mkdir()
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(SpecError, match="outside every allowed root"):
        discovering(world, tmp_path / "elsewhere", allowed_roots=[tmp_path / "inside"])
    _, mgr = discovering(world, tmp_path / "inside", allowed_roots=[tmp_path])
    assert mgr.adapter_dir == (tmp_path / "inside").resolve()


def test_a_target_module_the_model_lacks_is_refused(world: World) -> None:
    with pytest.raises(SpecError, match=r"lora_target_modules names \['v_porj'\]"):
        LoRAManager(fresh_model(world), None, max_lora_rank=4, lora_target_modules=["q_proj", "v_porj"])
    with pytest.raises(SpecError, match=r"max_lora_rank must be in 1\.\.16384"):
        LoRAManager(fresh_model(world), None, max_lora_rank=10**8, lora_target_modules=["q_proj"])


def test_misuse_of_an_attached_model_is_refused_clearly(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world)[:2], max_loras_per_batch=2)
    # A second manager would wrap the first's wrappers.
    with pytest.raises(SpecError, match="already wrapped by another LoRAManager"):
        LoRAManager(model, items(world)[:2], max_loras_per_batch=2)
    # The step's batch is two sequences: one sequence of ten tokens does not split into them.
    split = r"\(1, 10, 64\) does not split into the step's 2 sequences"
    with pytest.raises(ValueError, match=split), torch.no_grad(), mgr.batch(["a8", None]):
        model(tokens(1, 10, 28))
    beams = tokens(4, 3, 29)
    with torch.no_grad(), mgr.batch(["a8", None]):  # two beams a sequence, contiguous: served
        got = model(beams).logits
    assert_close(got, oracle(world, beams, ["a8", "a8", None, None]))
    model.to(torch.float64)
    changed = "the model's dtype when the LoRAManager was built"
    with pytest.raises(lora_pin.OpArgumentError, match=changed), torch.no_grad(), mgr.batch(["a8"]):
        model(tokens(1, 3, 30))
    model.to(torch.float32)
    mgr.detach()
    LoRAManager(model, items(world)[:2], max_loras_per_batch=2).detach()  # once detached, a new one may


def test_names_that_are_not_names_are_refused_by_position(world: World) -> None:
    mgr = LoRAManager(fresh_model(world), items(world)[:2], max_loras_per_batch=2)
    with pytest.raises(
        lora_pin.UsageError, match=r"names\[1\] must be an adapter name \(str\) or None, got int"
    ):
        mgr.prepare_step(["a8", 5], 1)  # type: ignore[list-item]
    with pytest.raises(lora_pin.UsageError, match="got the str 'a8'"), mgr.batch("a8"):
        pass
    mgr.registry.audit()
    assert mgr.registry.in_flight("a8") == 0


def test_finish_takes_only_the_active_step_once(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world), max_loras_per_batch=3)
    old = mgr.prepare_step(["a8"], 1)
    mgr.finish(old)
    with pytest.raises(lora_pin.LoraPinError, match="not the active one"):
        mgr.finish(old)  # twice
    current = mgr.prepare_step(["rs16", "a8"], 1)
    with pytest.raises(lora_pin.LoraPinError, match="not the active one"):
        mgr.finish(old)  # a stale step must not end the running one
    assert mgr.registry.in_flight("rs16") == 1 and mgr.registry.in_flight("a8") == 1
    with pytest.raises(lora_pin.LoraPinError, match="already active"):
        mgr.prepare_step(["a8"], 1)
    mgr.finish(current)
    assert mgr.registry.in_flight("a8") == 0
    mgr.registry.audit()


def test_two_target_modules_of_one_name_in_a_layer_are_two_targets(world: World) -> None:
    class WithTower(torch.nn.Module):  # a vision tower beside the language model, both numbered
        def __init__(self, lm: torch.nn.Module) -> None:
            super().__init__()
            self.language_model = lm
            self.vision = torch.nn.Module()
            self.vision.layers = copy.deepcopy(lm.model.layers)

    mgr = LoRAManager(
        WithTower(fresh_model(world)), lora_target_modules=["q_proj"], max_lora_rank=8, max_loras_per_batch=2
    )
    assert [g.key for g in mgr.targets.groups if ".0." in g.key] == [
        "language_model.model.layers.0.self_attn.q_proj",
        "vision.layers.0.self_attn.q_proj",
    ]
    assert (
        mgr.pool.buffers("vision.layers.0.self_attn.q_proj")[0]
        is not (mgr.pool.buffers("language_model.model.layers.0.self_attn.q_proj")[0])
    )


def test_an_unload_racing_a_load_of_the_same_name_keeps_the_new_adapter(world: World) -> None:
    model = fresh_model(world)
    mgr = LoRAManager(model, items(world)[:2], max_loras_per_batch=2)
    real = mgr.registry

    class LoadsDuringUnload:
        """The registry, but another thread's load lands between the unload and the manager's cleanup."""

        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        def __contains__(self, name: str) -> bool:
            return name in real

        def unload(self, name: str, timeout: float | None = None) -> None:
            real.unload(name, timeout)
            mgr.registry = real
            mgr.load("a8", world.adapters["pat"])  # the name reused for other weights

    mgr.registry = LoadsDuringUnload()  # type: ignore[assignment]
    mgr.unload("a8")
    assert mgr.registry is real and "a8" in real and "a8" in mgr.host
    ids = tokens(2, 4, 25)
    with torch.no_grad(), mgr.batch(["a8", "rs16"]):
        got = model(ids).logits
    assert_close(got, oracle(world, ids, ["pat", "rs16"]))
    real.audit()


def test_from_args(world: World) -> None:
    import argparse

    parser = lora_pin.add_lora_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        ["--lora-paths", *[f"{n}={p}" for n, p in world.adapters.items()], "--max-loras-per-batch", "3"]
    )
    model = fresh_model(world)
    mgr = LoRAManager.from_args(model, ns)
    names: list[str | None] = ["layer1", None, "mlp4"]
    ids = tokens(3, 4, 9)
    with torch.no_grad(), mgr.batch(names):
        got = model(ids).logits
    assert_close(got, oracle(world, ids, names))


class _Fused(torch.nn.Module):
    """A serving-framework-style decoder: fused qkv and gate/up projections, same module paths as Llama."""

    def __init__(self, base: Any) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for layer in base.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            block = torch.nn.Module()
            block.self_attn = torch.nn.Module()
            block.mlp = torch.nn.Module()
            block.self_attn.qkv_proj = _cat_linear(attn.q_proj, attn.k_proj, attn.v_proj)
            block.self_attn.o_proj = copy.deepcopy(attn.o_proj)
            block.mlp.gate_up_proj = _cat_linear(mlp.gate_proj, mlp.up_proj)
            block.mlp.down_proj = copy.deepcopy(mlp.down_proj)
            self.model.layers.append(block)


def _cat_linear(*parts: torch.nn.Linear) -> torch.nn.Linear:
    fused = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
    return fused


def test_fused_projections_equal_peft_per_module(world: World) -> None:
    toy = _Fused(world.base)
    base_attn = world.base.model.layers[0].self_attn
    q, k, v = base_attn.q_proj.out_features, base_attn.k_proj.out_features, base_attn.v_proj.out_features
    inter = world.base.model.layers[0].mlp.gate_proj.out_features
    fused = {
        "qkv_proj": [("q_proj", q), ("k_proj", k), ("v_proj", v)],
        "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
    }
    mgr = LoRAManager(
        toy, items(world), max_loras_per_batch=6, lora_target_modules=ATTN + MLP, fused_modules=fused
    )
    assert {g.name for g in mgr.targets.groups} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    names: list[str | None] = ["pat", None, "rs16", "mlp4", "layer1"]
    x = torch.randn(len(names), 3, base_attn.q_proj.in_features, generator=torch.Generator().manual_seed(5))
    peft_layers = world.peft.base_model.model.model.layers
    adapter_names = [n or "__base__" for n in names]
    for i, block in enumerate(toy.model.layers):
        with torch.no_grad(), mgr.batch(names):
            got_qkv = block.self_attn.qkv_proj(x)
            got_gate_up = block.mlp.gate_up_proj(x)
        with torch.no_grad():
            pa, pm = peft_layers[i].self_attn, peft_layers[i].mlp
            want_qkv = torch.cat(
                [m(x, adapter_names=adapter_names) for m in (pa.q_proj, pa.k_proj, pa.v_proj)], -1
            )
            want_gate_up = torch.cat(
                [m(x, adapter_names=adapter_names) for m in (pm.gate_proj, pm.up_proj)], -1
            )
        assert_close(got_qkv, want_qkv)
        assert_close(got_gate_up, want_gate_up)
        with torch.no_grad():
            assert torch.equal(got_qkv[1], block.self_attn.qkv_proj.base_layer(x)[1]), (
                "a base row was touched"
            )


def test_fused_modules_are_checked(world: World) -> None:
    toy = _Fused(world.base)
    with pytest.raises(lora_pin.SpecError, match="add up to"):
        LoRAManager(
            toy, items(world), fused_modules={"qkv_proj": [("q_proj", 1), ("k_proj", 1), ("v_proj", 1)]}
        )
    with pytest.raises(lora_pin.SpecError, match="must stack one of"):
        LoRAManager(toy, items(world), fused_modules={"qkv_proj": [("q_proj", 64), ("v_proj", 64)]})


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_model_families_equal_peft(family: str, tmp_path: Path) -> None:
    """Qwen2 (q/k/v with bias) and Mistral models are wrapped by module name like Llama."""
    from peft import PeftModel
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model_cls, config = (
        (Qwen2ForCausalLM, Qwen2Config(**shape))
        if family == "qwen2"
        else (MistralForCausalLM, MistralConfig(**shape))
    )
    base = model_cls(config).eval()
    base.save_pretrained(tmp_path / "base")
    adapters = {
        "x": make_peft_adapter(base, tmp_path / "x", r=8, lora_alpha=16, target_modules=ATTN + MLP, seed=11),
        "y": make_peft_adapter(
            base, tmp_path / "y", r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], seed=12
        ),
    }
    peft = PeftModel.from_pretrained(
        model_cls.from_pretrained(tmp_path / "base"), adapters["x"], adapter_name="x"
    )
    peft.load_adapter(adapters["y"], adapter_name="y")
    peft.eval()
    model = model_cls.from_pretrained(tmp_path / "base").eval()
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=2)
    names: list[str | None] = ["y", None, "x"]
    ids = tokens(3, 5, 21)
    with torch.no_grad(), mgr.batch(names):
        got = model(ids).logits
    with torch.no_grad():
        want = peft(ids, adapter_names=[n or "__base__" for n in names]).logits
    assert_close(got, want)
    with torch.no_grad():
        base_logits = model(ids).logits  # no active step: the wrapped model is the base model
    assert torch.equal(got[1], base_logits[1]), "the base-model row was touched"
    assert not torch.equal(got[0], base_logits[0]) and not torch.equal(got[2], base_logits[2])


def test_evictions_by_adapter_stay_bounded_over_endless_names(world: World) -> None:
    from lora_pin.model.eviction_counts import MAX_EVICTION_KEYS

    options = dict(max_loras_per_batch=1, max_loaded_loras=2, max_lora_rank=16)
    mgr = LoRAManager(fresh_model(world), None, lora_target_modules=ATTN + MLP, **options)
    names = MAX_EVICTION_KEYS + 100
    for i in range(names):
        mgr.load(f"n{i}", world.adapters["a8"])
    stats = mgr.stats()
    by_adapter = stats["evictions_by_adapter"]
    assert len(by_adapter) <= MAX_EVICTION_KEYS
    evicted = stats["host"]["evictions"] + stats["device"]["evictions"]
    assert evicted == names - 2
    assert sum(by_adapter.values()) + stats["evictions_by_adapter_others"] == evicted
