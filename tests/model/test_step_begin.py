"""The step transaction at the Rust/Python seam: one core call plans a step and acquires its requests,
``finish`` releases everything; the admission budget and the split come from the core alone.

Each race test forces its interleaving deterministically: a stand-in for the registry runs the other
thread's operations right after the step's planning call returns, where a plan-then-acquire step had
its window.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import LoRAManager
from lora_pin.errors import AdapterInUseError, AdapterLoadError, CapacityError, UnloadTimeoutError
from lora_pin.fixtures import make_peft_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))


def manager(linears_world: tuple[Any, dict[str, Path]], names: str, **kwargs: Any) -> tuple[LoRAManager, Any]:
    base, paths = linears_world
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model,
        [f"{n}={paths[n]}" for n in names],
        max_lora_rank=4,
        lora_target_modules=TARGETS,
        **kwargs,
    )
    return mgr, model


def logits(mgr: LoRAManager, model: Any, names: list[str | None]) -> torch.Tensor:
    with torch.no_grad(), mgr.batch(names):
        return model(IDS.expand(len(names), -1)).logits


class AfterPlanning:
    """Stands in for the manager's registry and runs ``interleave`` once, right after the step's
    planning call (``begin_step``, or ``plan`` where planning and acquiring are separate calls)."""

    def __init__(self, registry: Any, interleave: Any) -> None:
        self._registry = registry
        self._interleave = interleave

    def __getattr__(self, attr: str) -> Any:
        real = getattr(self._registry, attr)
        if attr not in ("begin_step", "plan") or self._interleave is None:
            return real

        def planned(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            interleave, self._interleave = self._interleave, None
            interleave()
            return result

        return planned

    def __contains__(self, name: object) -> bool:
        return name in self._registry


def install(mgr: LoRAManager, interleave: Any) -> None:
    proxy = AfterPlanning(mgr.registry, interleave)
    mgr.registry = proxy  # type: ignore[assignment]
    residency = getattr(mgr, "residency", None)
    if residency is not None:
        residency.registry = proxy


def on_another_thread(fn: Any) -> Any:
    """Runs ``fn`` on a thread, waits for it, and returns what it returned or raised."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the other thread hung"
    return outcome[0]


def test_a_reload_between_plan_and_acquire_never_serves_other_weights_nor_sticks(linears_world: Any) -> None:
    """Another thread unloads ``a`` and loads ``b``'s weights as ``a`` while a step over ``a`` is being
    set up. The step must compute with the registration it was planned for (the old ``a``), the
    other thread's unload must wait for the step rather than slip in, and ``in_flight`` must return
    to zero so that the unload and the reload can complete afterwards."""
    _, paths = linears_world
    mgr, model = manager(linears_world, "ab", max_loras_per_batch=2)
    want_a = logits(mgr, model, ["a"])
    want_b = logits(mgr, model, ["b"])
    mgr.unload("a")
    mgr.load("a", paths["a"])  # not resident in a slot: the step plans a load
    seen: list[Any] = []

    def unload_and_reload() -> None:
        seen.append(on_another_thread(lambda: mgr.unload("a", timeout=0.2)))
        seen.append(on_another_thread(lambda: mgr.load("a", paths["b"])))

    install(mgr, unload_and_reload)
    got = logits(mgr, model, ["a"])
    torch.testing.assert_close(got, want_a, rtol=1e-5, atol=1e-6)
    assert isinstance(seen[0], UnloadTimeoutError), seen
    assert isinstance(seen[1], AdapterInUseError), seen
    assert mgr.registry.in_flight("a") == 0
    # The unload goes on once the step is done, and the name can then be loaded again.
    on_another_thread(lambda: mgr.unload("a", timeout=5))
    mgr.load("a", paths["b"])
    torch.testing.assert_close(logits(mgr, model, ["a"]), want_b, rtol=1e-5, atol=1e-6)
    mgr.registry.audit()


def test_a_step_whose_adapter_is_unloaded_meanwhile_keeps_its_weights(linears_world: Any) -> None:
    """The same interleaving on a prepared (packed) step, for a resident adapter: the step holds its
    adapter, so an unload waits until ``finish``."""
    mgr, model = manager(linears_world, "ab", max_loras_per_batch=2)
    want_b = logits(mgr, model, ["b"])
    seen: list[Any] = []
    install(mgr, lambda: seen.append(on_another_thread(lambda: mgr.unload("b", timeout=0.2))))
    step = mgr.prepare_step(["b"], [5])
    with torch.no_grad():
        out = model(IDS).logits
    mgr.finish(step)
    torch.testing.assert_close(out, want_b, rtol=1e-5, atol=1e-6)
    assert isinstance(seen[0], UnloadTimeoutError), seen
    assert mgr.registry.in_flight("b") == 0
    on_another_thread(lambda: mgr.unload("b", timeout=5))
    assert "b" not in mgr.registry


def test_split_and_batch_budget_count_pins_evicted_from_host_memory(linears_world: Any) -> None:
    """``a`` was evicted from the host tier (four adapters, room for three) and then pinned: the budget
    for unpinned adapters is one slot less. A copy of the rule in Python read the host tier's pinned
    list, missed ``a``, and split ``b, c, d`` into one batch that ``batch()`` then refused."""
    _, paths = linears_world
    mgr, model = manager(linears_world, "abc", max_loras_per_batch=3, max_loaded_loras=3)
    mgr.load("d", paths["d"])
    assert "a" not in mgr.registry.stats()["host"]["resident"]
    mgr.pin("a")
    names: list[str | None] = ["b", "c", "d"]
    groups = mgr.split(names)
    assert groups == [[0, 1], [2]]
    for group in groups:
        logits(mgr, model, [names[i] for i in group])
    assert mgr.registry.stats()["pinned_names"] == ["a"]
    mgr.registry.audit()


def copy_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def residency(mgr: LoRAManager) -> tuple[list[str], list[str]]:
    stats = mgr.registry.stats()
    return sorted(stats["host"]["resident"]), sorted(stats["device"]["resident"])


@pytest.mark.parametrize("loading", ["blocking", "background"])
def test_a_failed_re_read_changes_no_other_adapter(linears_world: Any, tmp_path: Path, loading: str) -> None:
    """``a`` was evicted from host memory and its files broke since: a step over it fails, and the
    adapters the host tier would have evicted to make room for it stay in both tiers, in either loading
    mode (a background read sets its host memory aside without evicting anyone)."""
    _, paths = linears_world
    mgr, model = manager(linears_world, "", max_loras_per_batch=2, max_loaded_loras=2, loading=loading)
    mgr.load("a", copy_adapter(paths["a"], tmp_path / "a"))
    mgr.load("b", paths["b"])
    mgr.load("c", paths["c"])  # evicts a from the host tier
    logits(mgr, model, ["b", "c"])  # b and c in both tiers
    before = residency(mgr)
    assert before == (["b", "c"], ["b", "c"])
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterLoadError, match=r"adapter 'a'|adapter \"a\""):
        logits(mgr, model, ["a"])
    assert residency(mgr) == before
    assert mgr.registry.in_flight("a") == 0
    mgr.registry.audit()


@pytest.mark.parametrize("loading", ["blocking", "background"])
def test_a_re_read_of_changed_files_is_refused_and_counts_stay_true(
    linears_world: Any, tmp_path: Path, loading: str
) -> None:
    """``a``'s files were replaced by a larger adapter after it was evicted from host memory: reading
    it back is refused as a changed adapter, so the host tier never holds more bytes than it counts
    (nor than ``max_host_bytes``). Neither a blocking nor a background read changes another adapter: a
    background read sets its host memory aside without evicting anyone, and releases it when it fails."""
    base, paths = linears_world
    small = make_peft_adapter(base, tmp_path / "a", r=2, lora_alpha=8, target_modules=["q_proj"], seed=5)
    mgr, model = manager(linears_world, "", max_loras_per_batch=2, max_loaded_loras=2, loading=loading)
    mgr.load("a", small)
    mgr.load("b", paths["b"])
    mgr.load("c", paths["c"])  # evicts a from the host tier
    registered = mgr.stats()["host"]["bytes"]
    for f in paths["d"].iterdir():  # rank 4 on every target: more bytes than a was registered with
        (small / f.name).write_bytes(f.read_bytes())
    with pytest.raises(AdapterLoadError, match="changed on disk"):
        logits(mgr, model, ["a"])
    stats = mgr.stats()
    assert residency(mgr)[0] == ["b", "c"]
    assert stats["host_bytes"] == stats["host"]["bytes"] == registered
    assert stats["host"]["reserved_bytes"] == 0
    mgr.registry.audit()


def test_ctrl_c_during_a_slot_fill_propagates_and_keeps_state(
    linears_world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt (or SystemExit) while a slot is filled is raised as itself, not wrapped
    as an AdapterLoadError, and the step is released as for any failed load."""
    mgr, model = manager(linears_world, "abc", max_loras_per_batch=2)
    logits(mgr, model, ["a", "b"])
    original = mgr.pool.fill

    def interrupted(slot: int, adapter: Any) -> Any:
        original(slot, adapter)
        raise KeyboardInterrupt

    for exc in (KeyboardInterrupt, SystemExit):
        monkeypatch.setattr(mgr.pool, "fill", interrupted if exc is KeyboardInterrupt else _exits(original))
        with pytest.raises(exc):
            logits(mgr, model, ["c"])
        assert "c" not in mgr.registry.stats()["device"]["resident"]
        assert all(mgr.registry.in_flight(n) == 0 for n in "abc")
        mgr.registry.audit()
    monkeypatch.undo()
    want_c = logits(mgr, model, ["c"])
    assert want_c.shape[0] == 1


def _exits(original: Any) -> Any:
    def exits(slot: int, adapter: Any) -> Any:
        original(slot, adapter)
        raise SystemExit(3)

    return exits


_POOL_PEAK = """
import json, resource, sys, torch, transformers
from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError
transformers.logging.set_verbosity_error()
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    LoRAManager(model, [f"a={sys.argv[2]}"])
    outcome = "served"
except AdapterLoadError as exc:
    outcome = str(exc)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"outcome": outcome, "grew_kib": grew}))
"""


def test_a_config_claiming_a_huge_rank_never_sizes_the_pool(linears_world: Any, tmp_path: Path) -> None:
    """Without ``max_lora_rank`` the pool was sized from a start-up adapter's config before its tensors
    were checked: a config claiming rank 16,384 over rank-4 tensors cost +1.26 GiB of memory on a tiny
    model, and only then was refused. Now the adapter is read and checked first."""
    import json
    import subprocess
    import sys

    base, _ = linears_world
    model_dir = tmp_path / "model"
    base.save_pretrained(model_dir)
    adapter = make_peft_adapter(base, tmp_path / "liar", r=4, lora_alpha=8, target_modules=TARGETS, seed=3)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["r"] = 16_384
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-c", _POOL_PEAK, str(model_dir), str(adapter)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert "16384" in report["outcome"] and "rank" in report["outcome"], report
    assert report["grew_kib"] < 100 * 1024, report  # the pool alone would take over 1 GiB


def test_a_batch_refused_whole_reads_nothing_and_changes_no_tier(linears_world: Any) -> None:
    """``batch()`` over more adapters than the slots is refused before any evicted adapter is read back
    (which would have made room in the host tier for a batch that never runs)."""
    _, paths = linears_world
    mgr, model = manager(linears_world, "", max_loras_per_batch=2, max_loaded_loras=2)
    for name in "abc":
        mgr.load(name, paths[name])  # c's registration evicts a from the host tier
    before = residency(mgr), mgr.registry.stats()["host"]
    with pytest.raises(CapacityError, match="3 distinct unpinned adapters but 2 slots"):
        logits(mgr, model, ["a", "b", "c"])
    assert (residency(mgr), mgr.registry.stats()["host"]) == before
    assert all(mgr.registry.in_flight(n) == 0 for n in "abc")
