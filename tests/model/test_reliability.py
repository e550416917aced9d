"""Bad input, bad luck and load: fuzzed entry points, threads, load/unload cycles, a failed slot fill, and
the security rules end to end.

Short by default (CI); ``LORA_PIN_LONG=1`` runs the long variants (more fuzz examples, 10,000 cycles,
longer thread runs). Every test records its figures in ``FIGURES``, printed at the end with ``-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lora_pin
from lora_pin import (
    AdapterLoadError,
    LoRAManager,
    LoraPinError,
    PathNotAllowedError,
    SpecError,
    StalePlanError,
    UnsafeFormatError,
)
from lora_pin.weights import AdapterConfig, open_adapter, read_adapter_config

LONG = os.environ.get("LORA_PIN_LONG") == "1"
FUZZ_EXAMPLES = 20_000 if LONG else 300
CYCLES = 10_000 if LONG else 2_000
STEPS_PER_THREAD_RUN = 2_000 if LONG else 150
# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120
FIGURES: dict[str, Any] = {}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=not LONG,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    print("\nreliability figures:", json.dumps(FIGURES, sort_keys=True))


def count(name: str) -> None:
    FIGURES[name] = FIGURES.get(name, 0) + 1


def wait_for(condition: Callable[[], bool]) -> None:
    """Poll what the system reports until ``condition`` holds; only a hang ends it otherwise."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "hung: the condition never held"
        time.sleep(0.005)


# ---- fuzzing every entry point that takes user strings ------------------------------------------------

_json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
_json = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_spec_keys = st.sampled_from(["lora_name", "lora_path", "pinned", "name", "path", "base_model_name", "x"])
_spec_item = (
    st.text(max_size=40)
    | st.builds(lambda n, p: f"{n}={p}", st.text(max_size=10), st.text(max_size=20))
    | st.dictionaries(_spec_keys, _json_scalars, max_size=4).map(json.dumps)
    | st.dictionaries(_spec_keys, _json_scalars, max_size=4)
    | _json
)


@FUZZ
@given(
    items=st.none() | st.lists(_spec_item, max_size=5) | st.dictionaries(st.text(), _json_scalars, max_size=3)
)
def test_fuzz_parse_lora_paths(items: Any) -> None:
    count("parse_lora_paths")
    try:
        refs = lora_pin.parse_lora_paths(items, max_loras_per_batch=4)
    except LoraPinError:
        return
    for ref in refs:  # what parses round-trips through its own spec
        assert lora_pin.parse_lora_paths([ref.to_spec()])[0].lora_name == ref.lora_name


@FUZZ
@given(
    name=st.text(max_size=20),
    path=st.text(max_size=40),
    pinned=_json_scalars,
    lora_id=st.none() | st.text(max_size=40),
)
def test_fuzz_lora_ref(name: str, path: str, pinned: Any, lora_id: str | None) -> None:
    count("LoRARef")
    # TypeError: PyO3's own argument conversion (pinned must be a bool), before lora_pin's code runs.
    with contextlib.suppress(LoraPinError, TypeError):
        lora_pin.LoRARef(name, path, pinned=pinned, lora_id=lora_id)


@FUZZ
@given(
    argv=st.lists(
        st.sampled_from(
            [
                "--lora-paths",
                "--max-loras-per-batch",
                "--max-loaded-loras",
                "--max-lora-rank",
                "--lora-target-modules",
                "--lora-eviction-policy",
                "all",
                "0",
                "-1",
                "3",
                "x=y",
                "{",
                "q_proj",
                "lru",
                "fifo",
                "a=/p",
            ]
        )
        | st.text(max_size=12),
        max_size=8,
    )
)
def test_fuzz_server_args(argv: list[str]) -> None:
    count("server_args")
    parser = lora_pin.add_lora_args(argparse.ArgumentParser(exit_on_error=False))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            namespace = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit):
        return  # argparse's own refusal of the command line, before lora_pin sees it
    with contextlib.suppress(LoraPinError):
        lora_pin.lora_config_from_args(namespace)


@FUZZ
@given(
    data=st.dictionaries(
        st.sampled_from(
            [
                "r",
                "lora_alpha",
                "target_modules",
                "rank_pattern",
                "alpha_pattern",
                "use_rslora",
                "layers_to_transform",
                "layers_pattern",
                "exclude_modules",
                "peft_type",
                "bias",
                "use_dora",
                "fan_in_fan_out",
                "modules_to_save",
            ]
        ),
        _json,
        max_size=8,
    )
    | _json
)
def test_fuzz_adapter_config(data: Any) -> None:
    count("adapter_config")
    try:
        config = AdapterConfig.from_mapping("fuzz", "adapter_config.json", data)
    except AdapterLoadError as exc:
        assert "'fuzz'" in str(exc)
        return
    config.targets("model.layers.0.self_attn.q_proj")  # a config that parses can be matched


@FUZZ
@given(raw=st.binary(max_size=200) | _json.map(lambda d: json.dumps(d).encode()))
def test_fuzz_config_file_bytes(tmp_path: Path, raw: bytes) -> None:
    count("config_file")
    (tmp_path / "adapter_config.json").write_bytes(raw)
    try:
        read_adapter_config("fuzz", tmp_path)
    except AdapterLoadError as exc:
        assert "'fuzz'" in str(exc)


_header_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "I32", "BOOL", "F64", "XX"]),
        "shape": st.lists(st.integers(-2, 5), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 200), min_size=0, max_size=3),
    }
)
_tensor_names = st.sampled_from(
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        "x",
        "__metadata__",
    ]
)


@FUZZ
@given(
    header=st.dictionaries(_tensor_names, _header_entry | _json, max_size=4),
    length_delta=st.integers(-3, 3) | st.integers(-(2**63), 2**64 - 1),
    body=st.binary(max_size=128),
)
def test_fuzz_safetensors_header(tmp_path: Path, header: Any, length_delta: int, body: bytes) -> None:
    count("safetensors_header")
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]})
    )
    raw = json.dumps(header).encode()
    length = min(max(len(raw) + length_delta, 0), 2**64 - 1)
    (tmp_path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", length) + raw + body)
    try:
        file = open_adapter("fuzz", tmp_path)
        for pair in file.pairs.values():
            file.tensor(pair.a_name)
            file.tensor(pair.b_name)
    except AdapterLoadError as exc:
        assert "'fuzz'" in str(exc)


# ---- a served tiny Llama ------------------------------------------------------------------------------


@dataclass
class World:
    root: Path
    base_dir: Path
    paths: dict[str, Path]
    model: Any


ADAPTERS: dict[str, dict[str, Any]] = {
    "a": dict(r=4, lora_alpha=8, target_modules=ATTN + MLP, seed=1),
    "b": dict(r=8, lora_alpha=4, target_modules=ATTN, seed=2),
    "c": dict(r=2, lora_alpha=2, target_modules=MLP, seed=3),
    "d": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], seed=4),
    "e": dict(r=8, lora_alpha=16, target_modules=ATTN + MLP, seed=5),
    "f": dict(r=2, lora_alpha=8, target_modules=["o_proj", "down_proj"], seed=6),
}


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: Path,
    make_adapters: Callable[..., dict[str, Path]],
) -> World:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    base_dir = tiny_llama_dir
    paths = make_adapters(root, ADAPTERS)
    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    return World(root, base_dir, paths, model)


def manager(world: World, names: list[str], slots: int, **kwargs: Any) -> tuple[LoRAManager, torch.nn.Module]:
    model = copy.deepcopy(world.model)
    mgr = LoRAManager(
        model,
        [f"{n}={world.paths[n]}" for n in names],
        max_loras_per_batch=slots,
        max_lora_rank=8,
        lora_target_modules=ATTN + MLP,
        **kwargs,
    )
    return mgr, model


IDS = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(7))


def references(
    mgr: LoRAManager, model: torch.nn.Module, names: list[str | None]
) -> dict[str | None, torch.Tensor]:
    """Each adapter's logits for ``IDS``, one adapter per batch, before any concurrency."""
    out = {}
    for name in names:
        with torch.no_grad(), mgr.batch([name]):
            out[name] = model(IDS).logits[0]
    assert len({t.sum().item() for t in out.values()}) == len(out), (
        "adapters must differ for the test to bite"
    )
    return out


def run_batch(mgr: LoRAManager, model: torch.nn.Module, names: list[str | None]) -> torch.Tensor:
    with torch.no_grad(), mgr.batch(names):
        return model(IDS.expand(len(names), -1)).logits


# ---- threads ------------------------------------------------------------------------------------------


def test_threads_load_unload_pin_while_steps_run(world: World) -> None:
    stable = ["a", "b", "c"]
    churn = ["d", "e", "f"]
    mgr, model = manager(world, stable + churn, slots=3, max_loaded_loras=6)
    want = references(mgr, model, [None, *stable, *churn])
    stop = threading.Event()
    errors: list[BaseException] = []
    steps = [0]
    ops: dict[str, int] = {"load": 0, "unload": 0, "pin": 0, "unpin": 0, "refused": 0}

    def guard(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                stop.set()

        return run

    def others_ran() -> bool:
        # The stepper runs on until the other threads have each done their part at least once: how
        # far they get in its steps is the scheduler's business, not the test's.
        return ops["load"] > 0 and ops["unload"] > 0 and ops["pin"] > 0

    @guard
    def stepper() -> None:
        rng = random.Random(1)
        while (steps[0] < STEPS_PER_THREAD_RUN or not others_ran()) and not stop.is_set():
            names: list[str | None] = [rng.choice([None, *stable, *churn]) for _ in range(rng.randint(1, 4))]
            try:
                groups = mgr.split(names)
            except lora_pin.AdapterNotFoundError:
                groups = []
                ops["refused"] += 1
            for group in groups:
                sub = [names[i] for i in group]
                try:
                    got = run_batch(mgr, model, sub)
                except (lora_pin.AdapterNotFoundError, lora_pin.CapacityError):
                    ops["refused"] += (
                        1  # unloaded or pinned by another thread since split: refused, not wrong
                    )
                    continue
                for row, name in enumerate(sub):
                    torch.testing.assert_close(got[row], want[name], rtol=1e-5, atol=1e-6)
            steps[0] += 1
        stop.set()

    @guard
    def churner() -> None:
        rng = random.Random(2)
        while not stop.is_set():
            name = rng.choice(churn)
            if name in mgr.registry:
                mgr.unload(name, timeout=HANG_GUARD_S)
                ops["unload"] += 1
            else:
                mgr.load(name, world.paths[name])
                ops["load"] += 1

    @guard
    def pinner() -> None:
        rng = random.Random(3)
        while not stop.is_set():
            name = rng.choice(stable)
            try:
                mgr.pin(name)
                ops["pin"] += 1
            except lora_pin.CapacityError:
                ops["refused"] += 1
            time.sleep(0.001)
            mgr.unpin(name)
            ops["unpin"] += 1

    threads = [threading.Thread(target=t) for t in (stepper, churner, pinner)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread did not finish"
    if errors:
        raise errors[0]
    mgr.registry.audit()
    FIGURES["threads"] = {
        "threads": len(threads),
        "steps": steps[0],
        "seconds": round(time.monotonic() - started, 2),
        **ops,
    }
    assert ops["load"] > 0 and ops["unload"] > 0 and ops["pin"] > 0


def test_unload_waits_for_in_flight_requests(world: World) -> None:
    mgr, _model = manager(world, ["a", "b"], slots=2)
    step = mgr.prepare_step(["a", None], [3, 2])
    returned = threading.Event()
    worker = threading.Thread(target=lambda: (mgr.unload("a", timeout=HANG_GUARD_S), returned.set()))
    worker.start()
    # The unload has begun once the registry lists "a" as unloading: no new request can take it now.
    wait_for(lambda: mgr.registry.stats()["unloading"] == ["a"])
    assert "a" not in mgr.registry
    # Its request is still in the step, which this thread holds: the unload cannot have returned.
    assert not returned.is_set(), "unload returned while a request still used the adapter"
    mgr.finish(step)
    worker.join(timeout=HANG_GUARD_S)
    assert returned.is_set() and "a" not in mgr.host


def test_stale_plan_is_detected(world: World) -> None:
    mgr, model = manager(world, ["a", "b", "c"], slots=2)
    want = references(mgr, model, ["a", "b", "c"])
    # A plan made behind the manager's back moves adapters between slots without filling them: the pool
    # no longer holds what the registry's slot epochs say.
    assert sorted(mgr.registry.stats()["device"]["resident"]) == ["b", "c"]
    plan = mgr.registry.begin_step(["a"], [1])  # a takes b's slot in the registry; nothing is copied
    for index in range(len(plan.loads)):
        mgr.registry.report_load(plan.ticket, index, True)  # type: ignore[arg-type]
    mgr.registry.finish_step(plan.ticket)  # type: ignore[arg-type]
    with pytest.raises(StalePlanError, match="slot epoch"):
        run_batch(mgr, model, ["a", "c"])
    got = run_batch(mgr, model, ["a", "c"])  # the stale adapter was marked not resident: reloaded
    torch.testing.assert_close(got[0], want["a"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want["c"], rtol=1e-5, atol=1e-6)
    # A write into a slot while a step uses it is caught when the step finishes.
    step = mgr.prepare_step(["a"], [1])
    slot = int(step.request_slots[0])
    mgr.pool.clear(slot)
    with pytest.raises(StalePlanError, match=f"slot\\(s\\) \\[{slot}\\]"):
        mgr.finish(step)
    assert mgr.registry.in_flight("a") == 0


# ---- fault injection ----------------------------------------------------------------------------------


def test_allocation_failure_while_filling_a_slot(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, model = manager(world, ["a", "b", "c"], slots=2)
    want = references(mgr, model, [None, "a", "b", "c"])
    run_batch(mgr, model, ["a", "b"])  # a and b resident; c must evict one of them
    before = mgr.registry.stats()
    original = mgr.pool._write
    failures: list[int] = []

    def write_then_fail(slot: int, adapter: Any, *, non_blocking: bool) -> None:
        if not failures:
            failures.append(slot)
            original(slot, adapter, non_blocking=non_blocking)  # the worst case: half or all written
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        original(slot, adapter, non_blocking=non_blocking)

    monkeypatch.setattr(mgr.pool, "_write", write_then_fail)
    with pytest.raises(AdapterLoadError, match=r"'c'.*slot .* failed.*out of memory"):
        run_batch(mgr, model, ["c", None])
    after = mgr.registry.stats()
    assert "c" not in after["device"]["resident"], "the failed adapter must not count as resident"
    assert mgr.pool.occupant(failures[0]) is None, "the half-written slot must be emptied"
    assert after["host"]["resident"] == before["host"]["resident"]
    assert all(mgr.registry.in_flight(n) == 0 for n in "abc")
    mgr.registry.audit()
    got = run_batch(mgr, model, ["c", None, "a"])  # the next step works, c included
    for row, name in enumerate(["c", None, "a"]):
        torch.testing.assert_close(got[row], want[name], rtol=1e-5, atol=1e-6)
    FIGURES["allocation_failures_injected"] = len(failures)


# ---- cycles -------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_load_unload_cycles_do_not_leak_memory_or_counters(world: World) -> None:
    mgr, model = manager(world, ["a", "b", "c"], slots=2, max_loaded_loras=3)
    want = references(mgr, model, ["a", "c"])
    mgr.unload("c")
    loads_before = mgr.registry.stats()["host"]["loads"]
    # Resident memory settles only after ~1,000 cycles since loads reuse their recipes
    # (weights/read_recipes.py; measured: +2.2 MiB over the first 1,000 cycles, then +132 KiB over the
    # next 3,000), so the growth is taken over CYCLES cycles after that many.
    warmup = 1_000
    started = time.monotonic()
    rss_after_warmup = 0
    for cycle in range(warmup + CYCLES):
        if cycle == warmup:
            rss_after_warmup = _rss_bytes()
        mgr.load("c", world.paths["c"])
        if cycle % 50 == 0:
            got = run_batch(mgr, model, ["c", "a"])
            torch.testing.assert_close(got[0], want["c"], rtol=1e-5, atol=1e-6)
        mgr.unload("c")
    growth = _rss_bytes() - rss_after_warmup
    stats = mgr.registry.stats()
    mgr.registry.audit()
    assert stats["registered"] == 2 and sorted(mgr.host) == ["a", "b"]
    assert stats["host"]["loads"] == loads_before + warmup + CYCLES, (
        stats
    )  # one host load per cycle, none lost or doubled
    assert stats["host"]["bytes"] == mgr.host.nbytes
    assert all(mgr.pool.occupant(s) != "c" for s in range(mgr.pool.slots))
    FIGURES["cycles"] = {
        "cycles": CYCLES,
        "seconds": round(time.monotonic() - started, 2),
        "rss_growth_bytes_after_warmup": growth,
    }
    # 10,000 cycles grew 7.1 MiB with safetensors' leaking get_tensor (~820 B per cycle), 0.65 MiB without
    # (benches/load_cycles.py); the bounds leave room for allocator noise, not for a leak per tensor read.
    limit = 2 << 20 if LONG else 1 << 20
    assert growth < limit, f"resident memory grew {growth} bytes over {CYCLES} cycles"


# ---- security end to end ------------------------------------------------------------------------------


def test_no_pickle_by_default_end_to_end(world: World, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    shutil.copytree(world.paths["a"], pickled)
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    mgr, _model = manager(world, ["b"], slots=2)
    with pytest.raises(UnsafeFormatError, match=r"'p'.*pickle"):
        mgr.load("p", pickled)
    with pytest.raises(UnsafeFormatError):  # start-up adapters too
        LoRAManager(copy.deepcopy(world.model), [f"p={pickled}"], max_loras_per_batch=2)
    opted_in, opted_model = manager(world, ["b"], slots=2, allow_pickle=True)
    opted_in.load("p", pickled)
    safe, safe_model = manager(world, ["a"], slots=2)
    torch.testing.assert_close(
        run_batch(opted_in, opted_model, ["p"]), run_batch(safe, safe_model, ["a"]), rtol=1e-6, atol=1e-6
    )


def test_allowed_roots_end_to_end(world: World, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    inside = root / "ok"
    shutil.copytree(world.paths["a"], inside)
    outside = tmp_path / "elsewhere"
    shutil.copytree(world.paths["b"], outside)
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "sub").mkdir()
    model = copy.deepcopy(world.model)
    mgr = LoRAManager(
        model,
        [f"ok={inside}"],
        max_loras_per_batch=2,
        max_lora_rank=8,
        lora_target_modules=ATTN + MLP,
        allowed_roots=[root],
    )
    refused = {
        "absolute": (outside, "outside every allowed root"),
        "dotdot": (root / "sub" / ".." / "ok", "contains '..'"),
        "escape": (root / ".." / "elsewhere", "contains '..'"),
        "symlink": (root / "link", "outside every allowed root"),
        "fixture": (world.paths["c"], "outside every allowed root"),
    }
    for name, (path, why) in refused.items():
        with pytest.raises(PathNotAllowedError, match=f"'{name}'.*{why}"):
            mgr.load(name, path)
        assert name not in mgr.registry
    with pytest.raises(PathNotAllowedError):  # start-up adapters are held to the same roots
        LoRAManager(copy.deepcopy(world.model), [f"x={outside}"], max_loras_per_batch=2, allowed_roots=[root])
    mgr.load("ok2", root / "ok")
    assert sorted(mgr.host) == ["ok", "ok2"]


def test_lone_surrogates_in_names_and_paths_are_spec_errors(world: World) -> None:
    # json.loads('"\\ud800"') gives a str with no UTF-8 encoding: client traffic can send one.
    lone = "\ud800"
    mgr, model = manager(world, ["a"], slots=2, adapter_dir=world.root)
    calls: dict[str, Any] = {
        "load name": lambda: mgr.load(lone, world.paths["b"]),
        "load path": lambda: mgr.load("x", f"{world.paths['b']}{lone}"),
        "pin": lambda: mgr.pin(lone),
        "unpin": lambda: mgr.unpin(lone),
        "unload": lambda: mgr.unload(lone),
        "discover (adapter_dir)": lambda: mgr.discover(["a", lone]),
        "step (adapter_dir)": lambda: run_batch(mgr, model, ["a", lone]),
    }
    before = mgr.registry.stats()
    for what, call in calls.items():
        with pytest.raises(SpecError, match="lone surrogate"):
            call()
        assert mgr.registry.stats() == before, what
    count("lone_surrogate_calls")


def test_manager_passes_limits_through(world: World) -> None:
    with pytest.raises(AdapterLoadError, match=r"'b'.*above the limit max_tensors=3"):
        manager(world, ["b"], slots=2, max_tensors=3)
    mgr, _model = manager(world, ["b"], slots=2, max_file_bytes=1 << 20)
    with pytest.raises(AdapterLoadError, match=r"'big'.*above the limit max_file_bytes=1024"):
        LoRAManager(
            copy.deepcopy(world.model),
            [f"big={world.paths['a']}"],
            max_loras_per_batch=2,
            max_lora_rank=8,
            lora_target_modules=ATTN + MLP,
            max_file_bytes=1024,
        )
    assert "b" in mgr.registry
