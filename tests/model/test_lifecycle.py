"""Adapter identity and lifecycle through LoRAManager, against PEFT's forward of each version as the oracle:
digests and generations, in-place replacement (during a running step, refused, from every tier), loads from
tensors, and the placement snapshot under threads."""

from __future__ import annotations

import contextlib
import copy
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin import AdapterLoadError, AdapterNotFoundError, CapacityError, DuplicateAdapterError, LoRAManager
from lora_pin.model.lifecycle import AdapterIdentity

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "v1": dict(r=8, lora_alpha=16, target_modules=ATTN + MLP, seed=1),
    "v2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=2),
    "other": dict(r=8, lora_alpha=16, target_modules=ATTN, seed=3),
    "alpha": dict(r=8, lora_alpha=32, target_modules=ATTN + MLP, seed=1),
    "same": dict(r=8, lora_alpha=16, target_modules=ATTN + MLP, rank_pattern={"q_proj": 8}, seed=1),
    "rank_pattern": dict(r=8, lora_alpha=16, target_modules=ATTN + MLP, rank_pattern={"q_proj": 4}, seed=1),
    "alpha_pattern": dict(r=8, lora_alpha=16, target_modules=ATTN + MLP, alpha_pattern={"v_proj": 3}, seed=1),
}
A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@dataclass
class World:
    adapters: dict[str, Path]
    peft: Any
    base: Any
    root: Path


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: Path,
    make_adapters: Callable[..., dict[str, Path]],
) -> World:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lifecycle")
    adapters = make_adapters(root, ADAPTERS)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir), adapters["v1"], adapter_name="v1"
    )
    for name in ("v2", "other"):
        peft.load_adapter(adapters[name], adapter_name=name)
    peft.eval()
    return World(adapters, peft, AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval(), root)


def tokens(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 5), generator=torch.Generator().manual_seed(seed))


def oracle(world: World, ids: torch.Tensor, names: list[str | None]) -> torch.Tensor:
    with torch.no_grad():
        return world.peft(ids, adapter_names=[n or "__base__" for n in names]).logits


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def manager(world: World, **kwargs: Any) -> tuple[LoRAManager, torch.nn.Module]:
    model = copy.deepcopy(world.base)
    kwargs.setdefault("max_lora_rank", 8)
    kwargs.setdefault("lora_target_modules", ATTN + MLP)
    return LoRAManager(model, **kwargs), model


def run(mgr: LoRAManager, model: torch.nn.Module, names: list[str | None], seed: int) -> torch.Tensor:
    with torch.no_grad(), mgr.batch(names):
        return model(tokens(len(names), seed)).logits


def copy_adapter(
    source: Path, target: Path, change: Callable[[dict[str, torch.Tensor]], None] | None
) -> Path:
    shutil.copytree(source, target)
    if change is not None:
        weights = target / "adapter_model.safetensors"
        tensors = load_file(weights)
        change(tensors)
        save_file(tensors, weights)
    return target


def test_identity_is_a_frozen_record_and_generations_grow_across_unloads(world: World) -> None:
    mgr, _ = manager(world)
    ref = mgr.load("x", world.adapters["v1"])
    first = mgr.identity("x")
    assert isinstance(first, AdapterIdentity)
    assert (first.name, first.id, first.generation, len(first.digest)) == ("x", ref.lora_id, 1, 64)
    with pytest.raises(AttributeError):
        first.generation = 5  # type: ignore[misc]
    mgr.unload("x")
    with pytest.raises(AdapterNotFoundError):
        mgr.identity("x")
    mgr.load("x", world.adapters["v1"])
    again = mgr.identity("x")
    assert (again.digest, again.generation) == (first.digest, 2) and again.id != first.id
    mgr.load("y", world.adapters["other"])
    assert mgr.identity("y").generation == 1 and mgr.identity("y").digest != first.digest
    shown = mgr.stats()["identities"]
    assert shown == {
        n: {"id": i.id, "digest": i.digest, "generation": i.generation}
        for n, i in (("x", mgr.identity("x")), ("y", mgr.identity("y")))
    }


def test_same_files_in_two_folders_give_one_digest_and_any_served_change_another(
    world: World, tmp_path: Path
) -> None:
    def one_ulp(tensors: dict[str, torch.Tensor]) -> None:
        value = tensors[A_KEY][0, 0]
        tensors[A_KEY][0, 0] = torch.nextafter(value, torch.tensor(float("inf")))

    mgr, _ = manager(world)
    folders = {
        "copy": copy_adapter(world.adapters["v1"], tmp_path / "copy", None),
        "ulp": copy_adapter(world.adapters["v1"], tmp_path / "ulp", one_ulp),
        **{name: world.adapters[name] for name in ("alpha", "same", "rank_pattern", "alpha_pattern")},
    }
    mgr.load("v1", world.adapters["v1"])
    for name, folder in folders.items():
        mgr.load(name, folder)
    digest = {name: mgr.identity(name).digest for name in ["v1", *folders]}
    assert digest["copy"] == digest["v1"]
    # A rank pattern that gives q_proj the rank it has anyway serves the same thing.
    assert digest["same"] == digest["v1"]
    changed = [digest[n] for n in ("v1", "ulp", "alpha", "rank_pattern", "alpha_pattern")]
    assert len(set(changed)) == len(changed), digest


def test_a_replacement_during_a_step_serves_that_step_the_old_weights_and_the_next_the_new(
    world: World,
) -> None:
    mgr, model = manager(world, max_loras_per_batch=2)
    ref = mgr.load("live", world.adapters["v1"], pinned=True)
    before = mgr.identity("live")
    names: list[str | None] = ["live", None, "live"]
    ids = tokens(len(names), 1)
    with torch.no_grad(), mgr.batch(names):
        new_ref = mgr.load("live", world.adapters["v2"], replace=True)
        during = model(ids).logits
    close(during, oracle(world, ids, ["v1", None, "v1"]))
    after = run(mgr, model, names, 1)
    close(after, oracle(world, ids, ["v2", None, "v2"]))
    now = mgr.identity("live")
    assert (now.id, new_ref.lora_id, now.generation) == (ref.lora_id, ref.lora_id, before.generation + 1)
    assert now.digest != before.digest
    stats = mgr.stats()
    assert stats["pinned_names"] == ["live"] and stats["slot_refreshes"] == 1
    mgr.registry.audit()
    # A prepared step (the scheduler's path) likewise: the replacement lands after the step ends.
    ids = tokens(1, 2)
    step = mgr.prepare_step(["live"], ids.shape[1])
    mgr.load("live", world.adapters["v1"], replace=True)
    with torch.no_grad():
        got = model(ids).logits
    mgr.finish(step)
    close(got, oracle(world, ids, ["v2"]))
    close(run(mgr, model, ["live"], 3), oracle(world, tokens(1, 3), ["v1"]))


def test_a_refused_replacement_changes_nothing(world: World, tmp_path: Path) -> None:
    def nan(tensors: dict[str, torch.Tensor]) -> None:
        tensors[A_KEY][0, 0] = float("nan")

    def narrow(tensors: dict[str, torch.Tensor]) -> None:
        tensors[A_KEY] = tensors[A_KEY][:, :-1].contiguous()

    bad = {
        "nan": copy_adapter(world.adapters["v2"], tmp_path / "nan", nan),
        "shape": copy_adapter(world.adapters["v2"], tmp_path / "shape", narrow),
        "missing": tmp_path / "missing",
    }
    mgr, model = manager(world, max_loras_per_batch=2)
    mgr.load("live", world.adapters["v1"], pinned=True)
    mgr.load("other", world.adapters["other"])
    names: list[str | None] = ["live", "other", None]
    want = run(mgr, model, names, 4)
    for case, folder in bad.items():
        before = (mgr.identity("live"), mgr.placement(), mgr.stats())
        with pytest.raises(AdapterLoadError):
            mgr.load("live", folder, replace=True)
        after = (mgr.identity("live"), mgr.placement(), mgr.stats())
        assert after[0] == before[0] and after[1] == before[1], case
        for key in ("identities", "pinned_names", "host", "device", "host_bytes", "registered"):
            assert after[2][key] == before[2][key], (case, key)
        assert torch.equal(run(mgr, model, names, 4), want), case
    close(want, oracle(world, tokens(3, 4), ["v1", "other", None]))
    with pytest.raises(DuplicateAdapterError):
        mgr.load("live", world.adapters["v2"])


@pytest.mark.parametrize("source", ["path", "tensors"])
def test_a_replacement_that_leaves_another_adapter_no_room_beside_the_pins_is_refused(
    world: World, source: str
) -> None:
    """Host memory for a small pinned p and a big q: replacing p by big weights would leave q less room
    beside the pins than it needs (its requests would wait for host room forever), so it is refused with
    the rule ``pin`` applies, naming both adapters and the numbers, and nothing changes: identities, pin,
    host tier, outputs. q is still served."""
    from peft import LoraConfig

    sizes, _ = manager(world)
    sizes.load("small", world.adapters["v2"])
    sizes.load("big", world.adapters["v1"])
    small, big = sizes.placement()["small"].host_bytes, sizes.placement()["big"].host_bytes
    assert small < big
    mgr, model = manager(world, max_loras_per_batch=3, max_host_bytes=small + big)
    mgr.load("p", world.adapters["v2"], pinned=True)
    mgr.load("q", world.adapters["v1"])
    names: list[str | None] = ["p", "q", None]
    want = run(mgr, model, names, 12)
    close(want, oracle(world, tokens(3, 12), ["v2", "v1", None]))

    def state() -> tuple[Any, ...]:
        """Identities (digest, generation), placement (tiers, slots, pins, bytes), stats, host tensors."""
        identities = (mgr.identity("p"), mgr.identity("q"))
        return identities, mgr.placement(), mgr.stats(), {n: mgr.host[n] for n in mgr.host}

    before = state()
    with pytest.raises(CapacityError) as refused:
        if source == "path":
            mgr.load("p", world.adapters["v1"], replace=True)
        else:
            tensors = load_file(world.adapters["v1"] / "adapter_model.safetensors")
            config = LoraConfig.from_pretrained(str(world.adapters["v1"]))
            mgr.load_tensors("p", tensors, config, replace=True)
    message = str(refused.value)
    assert 'replace adapter "p"' in message and f'adapter "q" needs {big}' in message, message
    assert f"would take {big} of max_host_bytes={small + big}" in message, message
    after = state()
    assert after[0] == before[0] and after[1] == before[1]
    for key in ("identities", "pinned_names", "host_bytes", "registered"):
        assert after[2][key] == before[2][key], key
    assert after[2]["host"]["resident"] == before[2]["host"]["resident"] == ["p", "q"]
    assert after[3].keys() == before[3].keys() and all(after[3][n] is before[3][n] for n in before[3])
    assert torch.equal(run(mgr, model, names, 12), want)
    # q is served by a step of its own too (it was never evicted for the refused weights).
    step = mgr.prepare_step(["q"], 1)
    mgr.finish(step)
    assert step.admitted == (0,) and not step.deferred
    mgr.registry.audit()


def test_a_replacement_from_the_host_tier_or_disk_or_a_fetch_serves_the_new_weights(world: World) -> None:
    mgr, model = manager(world, max_loras_per_batch=2, max_loaded_loras=2)
    mgr.load("x", world.adapters["v1"])
    run(mgr, model, ["x"], 5)  # in a slot
    # The last plan named x; a plan naming only y leaves x the unnamed one registration evicts first.
    mgr.load("y", world.adapters["other"])
    run(mgr, model, ["y"], 5)
    mgr.load("z", world.adapters["other"])  # x leaves the host tier (and its slot)
    assert mgr.placement()["x"].tier == "disk"
    mgr.load("x", world.adapters["v2"], replace=True)
    assert mgr.placement()["x"].tier == "host"
    close(run(mgr, model, ["x", None], 6), oracle(world, tokens(2, 6), ["v2", None]))
    # Being fetched: the fetch is over, its read dropped; the waiting request runs on the new weights.
    mgr.load("y2", world.adapters["other"])
    run(mgr, model, ["y2"], 5)
    mgr.load("z2", world.adapters["other"])
    assert mgr.placement()["x"].tier == "disk"
    from peft import LoraConfig

    from lora_pin._testing import slow_store

    v1 = load_file(world.adapters["v1"] / "adapter_model.safetensors")
    v1_config = LoraConfig.from_pretrained(str(world.adapters["v1"]))
    with slow_store(gated=True) as store:
        step = mgr.prepare_step(["x"], 1)
        mgr.finish(step)
        assert step.loading == (0,) and mgr.placement()["x"].tier == "fetching"
        assert store.wait_for_read("x")
        # From tensors: the store holds reads from disk only.
        mgr.load_tensors("x", v1, v1_config, replace=True)
        assert mgr.placement()["x"].tier == "host"
        store.release("x")
    assert mgr.wait_loads(timeout=30)
    close(run(mgr, model, ["x"], 7), oracle(world, tokens(1, 7), ["v1"]))
    assert mgr.identity("x").generation == 3
    mgr.registry.audit()


def test_load_tensors_equals_a_load_from_disk_and_refuses_what_disk_refuses(
    world: World, tmp_path: Path
) -> None:
    from peft import LoraConfig

    mgr, model = manager(world, max_loras_per_batch=3)
    mgr.load("disk", world.adapters["v1"])
    tensors = load_file(world.adapters["v1"] / "adapter_model.safetensors")
    config = LoraConfig.from_pretrained(str(world.adapters["v1"]))
    mgr.load_tensors("memory", tensors, config)
    mgr.load_tensors("dict", dict(tensors), config.to_dict())
    assert mgr.identity("memory").digest == mgr.identity("disk").digest == mgr.identity("dict").digest
    ids = tokens(1, 9)
    outs = [run(mgr, model, [name], 9) for name in ("disk", "memory", "dict")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    close(outs[0], oracle(world, ids, ["v1"]))
    # Replacing from tensors.
    v2 = load_file(world.adapters["v2"] / "adapter_model.safetensors")
    mgr.load_tensors("memory", v2, LoraConfig.from_pretrained(str(world.adapters["v2"])), replace=True)
    close(run(mgr, model, ["memory"], 9), oracle(world, ids, ["v2"]))
    # What a disk load refuses, with the same error class and the same reason.
    cases: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
    nan = dict(tensors)
    nan[A_KEY] = tensors[A_KEY].clone()
    nan[A_KEY][0, 0] = float("nan")
    cases["nan"] = (nan, config.to_dict())
    narrow = dict(tensors)
    narrow[A_KEY] = tensors[A_KEY][:, :-1].contiguous()
    cases["shape"] = (narrow, config.to_dict())
    stray = dict(tensors)
    stray["base_model.model.stray.weight"] = torch.zeros(2, 2)
    cases["unused"] = (stray, config.to_dict())
    cases["dora"] = (dict(tensors), {**config.to_dict(), "use_dora": True})
    for case, (weights, fields_) in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        save_file(weights, folder / "adapter_model.safetensors")
        import json

        (folder / "adapter_config.json").write_text(json.dumps(_jsonable(fields_)))
        with pytest.raises(AdapterLoadError) as from_disk:
            mgr.load(case, folder)
        with pytest.raises(AdapterLoadError) as from_memory:
            mgr.load_tensors(case, weights, fields_)
        assert type(from_disk.value) is type(from_memory.value), case
        reason = str(from_disk.value).split("): ", 1)[1]
        assert reason in str(from_memory.value), (case, str(from_memory.value))
        assert case not in mgr.registry
    with pytest.raises(AdapterLoadError, match="mapping of tensor names"):
        mgr.load_tensors("bad", {"x": 1}, config)  # type: ignore[dict-item]
    with pytest.raises(AdapterLoadError, match="max_tensors"):
        small, _ = manager(world, max_tensors=3)
        small.load_tensors("many", tensors, config)


def _jsonable(value: Any) -> Any:
    from lora_pin.weights.tensors import _plain

    return _plain(value)


def test_tensors_changed_in_place_are_refused_when_read_again(world: World) -> None:
    from peft import LoraConfig

    mgr, model = manager(world, max_loras_per_batch=2, max_loaded_loras=2)
    tensors = load_file(world.adapters["v1"] / "adapter_model.safetensors")
    mgr.load_tensors("m", tensors, LoraConfig.from_pretrained(str(world.adapters["v1"])))
    mgr.load("y", world.adapters["other"])
    mgr.load("z", world.adapters["other"])
    assert mgr.placement()["m"].tier == "disk"
    tensors[A_KEY][0, 0] += 1.0
    with pytest.raises(AdapterLoadError, match="changed in memory since it was registered"):
        run(mgr, model, ["m"], 10)


def test_placement_agrees_with_stats_under_threaded_loads_and_unloads(world: World) -> None:
    mgr, model = manager(world, max_loras_per_batch=3, max_loaded_loras=4)
    stop = threading.Event()
    errors: list[BaseException] = []
    # Every churning thread stops halfway until the main thread is there too: at least one snapshot is
    # taken with their adapters loaded and the steps running, however the threads are scheduled.
    halfway = threading.Barrier(4, timeout=120)

    def churn(index: int) -> None:
        try:
            for round_ in range(15):
                if round_ == 7:
                    halfway.wait()
                name = f"t{index}-{round_ % 3}"
                if name in mgr.registry:
                    mgr.unload(name)
                else:
                    mgr.load(name, world.adapters["v1" if round_ % 2 else "other"], replace=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            halfway.abort()

    def steps() -> None:
        while not stop.is_set():
            names = [n for n in list(mgr.registry.stats()["host"]["resident"])[:2]] or [None]
            with contextlib.suppress(AdapterNotFoundError, AdapterLoadError):
                run(mgr, model, names, 11)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(3)]
    stepper = threading.Thread(target=steps)
    stepper.start()
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a churner failed: reported below
        halfway.wait()
    snapshots = 0
    while snapshots == 0 or any(t.is_alive() for t in threads):
        p = mgr.placement()
        assert p.free_slots == p.slots - sum(a.tier == "device" for a in p.adapters)
        assert p.host_bytes == sum(a.host_bytes for a in p.adapters if a.tier in ("device", "host"))
        assert [a.name for a in p.adapters] == sorted(a.name for a in p.adapters)
        assert all(a.generation >= 1 and len(a.digest) == 64 for a in p.adapters)
        snapshots += 1
    for t in threads:
        t.join()
    stop.set()
    stepper.join()
    assert not errors, errors
    p, stats = mgr.placement(), mgr.stats()
    assert sorted(a.name for a in p.adapters if a.tier in ("device", "host")) == stats["host"]["resident"]
    assert sorted(a.name for a in p.adapters if a.tier == "device") == stats["device"]["resident"]
    assert sorted(a.name for a in p.adapters if a.pinned) == stats["pinned_names"]
    assert p.host_bytes == stats["host"]["bytes"] and p.free_slots == 3 - stats["device"]["used"]
    assert {a.name: (a.digest, a.generation) for a in p.adapters} == {
        n: (i["digest"], i["generation"]) for n, i in stats["identities"].items()
    }
    assert {f.name for f in fields(p.adapters[0])} >= {"tier", "pinned", "in_flight", "digest", "generation"}
    mgr.registry.audit()
