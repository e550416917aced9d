"""Background loading: a step never reads an adapter from disk; the requests that need one wait (deferred,
in order) while the loader's threads read it, and a later step admits them.

The slow store (:func:`lora_pin._testing.slow_store`) holds reads in flight for as long as a test needs,
and records which thread ran each read: a read on the step's own thread would hang the test.
"""

from __future__ import annotations

import copy
import shutil
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import (
    AdapterLoadError,
    AdapterNotFoundError,
    LoRAManager,
    LoraPinError,
    SpecError,
    UsageError,
)
from lora_pin._core import OVERDUE_AFTER
from lora_pin._testing import slow_store

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = "abcdefgh"
IDS = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(11))


def manager(linears_world: Any, **kwargs: Any) -> tuple[LoRAManager, Any]:
    base, _ = linears_world
    model = copy.deepcopy(base)
    kwargs.setdefault("max_lora_rank", 4)
    kwargs.setdefault("lora_target_modules", TARGETS)
    return LoRAManager(model, **kwargs), model


@pytest.fixture(scope="module")
def want(linears_world: Any) -> dict[str | None, torch.Tensor]:
    """Each adapter's logits on ``IDS`` (and the base model's), from a blocking manager holding them all."""
    _, paths = linears_world
    mgr, model = manager(linears_world, lora_paths=[f"{n}={p}" for n, p in paths.items()], loading="blocking")
    out: dict[str | None, torch.Tensor] = {}
    for name in [None, *NAMES]:
        with torch.no_grad(), mgr.batch([name]):
            out[name] = model(IDS).logits
    return out


def run_one(mgr: LoRAManager, model: Any, name: str | None) -> tuple[Any, torch.Tensor | None]:
    """A packed step of one request of ``IDS``'s tokens; its logits if it was admitted."""
    step = mgr.prepare_step([name], [IDS.shape[1]])
    try:
        with torch.no_grad():
            out = model(IDS).logits if step.admitted else None
    finally:
        mgr.finish(step)
    return step, out


def evicted_world(linears_world: Any, **kwargs: Any) -> tuple[LoRAManager, Any]:
    """A manager whose host tier holds two of a, b, c: ``a`` was evicted from it by ``c``'s load."""
    _, paths = linears_world
    mgr, model = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=2, **kwargs)
    for name in "abc":
        mgr.load(name, paths[name])
    assert sorted(mgr.registry.stats()["host"]["resident"]) == ["b", "c"]
    return mgr, model


def test_a_step_defers_an_evicted_adapter_and_reads_it_off_its_thread(linears_world: Any, want: Any) -> None:
    """The step over ``a`` (evicted from host memory) returns while ``a``'s read is held in flight:
    ``a`` is deferred, the base-model and resident requests run and compute what they should. Once the
    read ends, the next step admits ``a``, and the read ran on a loader thread."""
    mgr, model = evicted_world(linears_world)
    with slow_store(gated=True) as store:
        step = mgr.prepare_step(["a", None, "b"], [5, 5, 5])
        mgr.finish(step)
        assert step.admitted == (1, 2) and step.deferred == step.loading == (0,) and not step.failed
        assert store.wait_for_read("a")
        _, got_b = run_one(mgr, model, "b")
        torch.testing.assert_close(got_b, want["b"], rtol=1e-5, atol=1e-6)
        again, _ = run_one(mgr, model, "a")
        assert again.deferred == (0,), "admitted before its read ended"
        store.release("a")
        assert mgr.wait_loads(timeout=30)
    step, got_a = run_one(mgr, model, "a")
    assert step.admitted == (0,)
    torch.testing.assert_close(got_a, want["a"], rtol=1e-5, atol=1e-6)
    readers = store.readers("a")
    assert len(readers) == 1 and readers[0].startswith("lora_pin-load"), readers
    assert mgr.stats()["background_loads"] == 1
    mgr.registry.audit()


def test_deferred_requests_keep_their_order(linears_world: Any) -> None:
    """Requests deferred for a read come back in request order, and resubmitted first they are admitted
    in that order. ``b``'s read would need the place of ``c`` or ``d``, whose requests run: it waits (no
    read takes the place of an adapter a request needs) until a step names them no more."""
    _, paths = linears_world
    mgr, _ = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=3)
    for name in "abcde":
        mgr.load(name, paths[name])  # a and b are out of host memory
    names: list[str | None] = ["a", "c", None, "b", "a", "d"]
    step = mgr.prepare_step(names, 1)
    mgr.finish(step)
    assert step.admitted == (1, 2, 5) and step.deferred == (0, 3, 4) and step.loading == (0, 3, 4)
    assert mgr.registry.stats()["host"]["fetching"] == ["a"], "e's place goes to a; none is left for b"
    assert mgr.wait_loads(timeout=30)
    waiting = [names[i] for i in step.deferred]
    again = mgr.prepare_step(waiting, 1)
    mgr.finish(again)
    assert again.admitted == (0, 2) and again.deferred == again.loading == (1,)
    assert mgr.wait_loads(timeout=30)
    last = mgr.prepare_step([waiting[i] for i in again.deferred], 1)
    mgr.finish(last)
    assert last.admitted == (0,)
    mgr.registry.audit()


def test_step_loading_names_the_requests_waiting_for_host_memory(linears_world: Any) -> None:
    """Of the deferred requests, ``loading`` lists those whose adapter is not in host memory (``a``, read
    now), not those waiting for a slot (``f``, resident)."""
    _, paths = linears_world
    mgr, _ = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=5)
    for name in "abcdef":
        mgr.load(name, paths[name])  # a is out of host memory
    step = mgr.prepare_step(["b", "c", "f", "a"], 1)
    mgr.finish(step)
    assert step.admitted == (0, 1) and step.deferred == (2, 3) and step.loading == (3,)


def test_no_request_waits_forever(linears_world: Any) -> None:
    """A scheduler that resubmits deferred requests first and prefetches its whole waiting queue before
    every step, over eight adapters with a host tier of two and two slots, with more arrivals than it can
    serve for a while: every prefetch would evict the adapters that finished reads brought in, were they
    entered into the host tier before the step that admits their requests, and their requests would
    never run. Every request is served, and none is overtaken by more than a step's worth of later ones."""
    _, paths = linears_world
    mgr, _ = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=2)
    for name in NAMES:
        mgr.load(name, paths[name])
    arrivals = deque((i, NAMES[(i * 3) % len(NAMES)]) for i in range(40))
    waiting: deque[tuple[int, str]] = deque()
    served_at: dict[int, int] = {}
    for t in range(300):
        for _ in range(2):
            if arrivals:
                waiting.append(arrivals.popleft())
        if not waiting:
            break
        batch = list(waiting)[:4]
        mgr.prefetch([name for _, name in waiting])
        step = mgr.prepare_step([name for _, name in batch], 1)
        mgr.finish(step)
        assert not step.failed
        admitted = {batch[i][0] for i in step.admitted}
        served_at.update((rid, t) for rid in admitted)
        waiting = deque(r for r in waiting if r[0] not in admitted)
        mgr.wait_loads(timeout=30)
    assert len(served_at) == 40, f"requests {sorted(set(range(40)) - served_at.keys())} never served"
    overtaken = {r: sum(served_at[later] < served_at[r] for later in range(r + 1, 40)) for r in range(40)}
    assert max(overtaken.values()) <= 4, overtaken
    mgr.registry.audit()


def test_a_cold_request_behind_steady_hot_traffic_is_served(linears_world: Any) -> None:
    """Two slots, a host tier of two, both held by hot adapters that new requests ask for at every step;
    a request for a cold adapter waits at the front of the queue. Were the hot adapters' admissions to
    keep the whole host tier, the cold adapter's read would never find room and its request would wait
    forever. Its read takes no place a request needs until it is overdue (deferred ``OVERDUE_AFTER``
    steps): then the hot adapter of the youngest request gives way, the read runs, and the request runs
    the step after."""
    _, paths = linears_world
    mgr, _ = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=2)
    for name in "cab":
        mgr.load(name, paths[name])  # c is out of host memory
    waiting: list[str | None] = ["c"]
    steps = 0
    while "c" in waiting and steps < 10:
        names = [*waiting, "a", "b", None]
        step = mgr.prepare_step(names, 1)
        mgr.finish(step)
        steps += 1
        waiting = [names[i] for i in step.deferred if i < len(waiting)]
        mgr.wait_loads(timeout=30)
    assert "c" not in waiting, "the cold request never ran"
    assert steps <= OVERDUE_AFTER + 2, steps
    mgr.registry.audit()


def test_a_failed_background_read_reaches_only_its_requests(linears_world: Any, tmp_path: Path) -> None:
    """``a``'s files broke after it was evicted from host memory: its read fails in the background, the
    next step lists ``a``'s requests in ``failed`` (neither admitted nor deferred), the other requests
    run, no other adapter moves (none ever left for ``a``'s read), and nothing is counted for ``a``. A
    later request retries the read."""
    _, paths = linears_world
    mgr, _ = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=3)
    folder = tmp_path / "a"
    shutil.copytree(paths["a"], folder)
    mgr.load("a", folder)
    for name in "bcd":
        mgr.load(name, paths[name])  # d evicts a from the host tier
    weights = folder / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file")
    step = mgr.prepare_step(["a"], 1)  # a's read begins, evicting nobody
    mgr.finish(step)
    assert step.deferred == (0,)
    assert mgr.wait_loads(timeout=30)
    mgr.finish(mgr.prepare_step([None], 1))  # the failure is installed; no request names a yet
    before = mgr.registry.stats()["host"]
    step = mgr.prepare_step(["c", "a", None, "a"], 1)
    mgr.finish(step)
    assert step.admitted == (0, 2) and step.deferred == ()
    assert sorted(step.failed) == [1, 3]
    assert all(isinstance(e, AdapterLoadError) and "'a'" in str(e) for e in step.failed.values())
    host = mgr.registry.stats()["host"]
    assert sorted(host["resident"]) == sorted(before["resident"]) == ["b", "c", "d"]
    assert host["bytes"] == before["bytes"] == mgr.stats()["host_bytes"]
    assert mgr.stats()["background_load_failures"] == 1
    mgr.registry.audit()
    weights.write_bytes(good)
    step = mgr.prepare_step(["a"], 1)
    mgr.finish(step)
    assert step.deferred == (0,) and not step.failed
    assert mgr.wait_loads(timeout=30)
    step = mgr.prepare_step(["a"], 1)
    mgr.finish(step)
    assert step.admitted == (0,)
    mgr.registry.audit()


def test_unloading_an_adapter_being_read_cancels_its_read(linears_world: Any) -> None:
    """``a`` is unloaded while its read is held in flight: the unload returns at once, nothing stays
    counted or held for it, and the read's result is dropped when it ends."""
    mgr, _ = evicted_world(linears_world)
    with slow_store(gated=True) as store:
        step = mgr.prepare_step(["a"], 1)
        mgr.finish(step)
        assert store.wait_for_read("a")
        assert mgr.registry.stats()["host"]["fetching"] == ["a"]
        assert mgr.registry.stats()["host"]["reserved_bytes"] > 0
        mgr.unload("a", timeout=5)
        assert "a" not in mgr.registry
        host = mgr.registry.stats()["host"]
        assert host["fetching"] == [] and host["reserved_bytes"] == 0
        store.release("a")
        assert mgr.wait_loads(timeout=30)
    step = mgr.prepare_step(["b"], 1)  # installs the read's completion: refused, dropped
    mgr.finish(step)
    assert "a" not in mgr.host
    stats = mgr.stats()
    assert stats["host_bytes"] == stats["host"]["bytes"]
    assert stats["background_loads"] == 0
    mgr.registry.audit()


def test_prefetch_reads_a_waiting_queue_ahead_of_its_steps(linears_world: Any, want: Any) -> None:
    """``prefetch`` takes a scheduler's queue (None and repeats included) and starts reading the adapters
    not in host memory (making room by evicting ``b``, which the queue does not name); the step that then
    needs ``a`` admits it at once."""
    mgr, model = evicted_world(linears_world)
    with slow_store() as store:
        assert mgr.prefetch(["a", None, "c", "a"]) == ["a"]
        assert mgr.wait_loads(timeout=30)
    step, got = run_one(mgr, model, "a")
    assert step.admitted == (0,)
    torch.testing.assert_close(got, want["a"], rtol=1e-5, atol=1e-6)
    assert [n for n, _ in store.reads] == ["a"]


def test_prefetch_refuses_bad_names_and_starts_nothing(linears_world: Any) -> None:
    mgr, _ = evicted_world(linears_world)
    with slow_store() as store:
        with pytest.raises(AdapterNotFoundError, match="nope"):
            mgr.prefetch(["a", "nope"])
        with pytest.raises(UsageError, match="str"):
            mgr.prefetch("a")
        assert mgr.wait_loads(timeout=30)
    assert store.reads == []
    assert mgr.stats()["loads_in_flight"] == 0
    mgr.registry.audit()
    mgr.detach()
    with pytest.raises(LoraPinError, match="detached"):
        mgr.prefetch(["a"])


def test_discovery_reads_through_the_loader(linears_world: Any, want: Any, tmp_path: Path) -> None:
    """A step naming an ``adapter_dir`` adapter not registered yet defers it while the loader reads it;
    the next step admits it. A name with no folder fails the whole step, which plans nothing."""
    _, paths = linears_world
    shutil.copytree(paths["d"], tmp_path / "org" / "d")
    mgr, model = manager(linears_world, max_loras_per_batch=2, adapter_dir=tmp_path)
    with slow_store(gated=True) as store:
        step, _ = run_one(mgr, model, "org/d")
        assert step.deferred == (0,)
        assert store.wait_for_read("org/d")
        assert "org/d" not in mgr.registry
        store.release()
        assert mgr.wait_loads(timeout=30)
    step, got = run_one(mgr, model, "org/d")
    assert step.admitted == (0,)
    torch.testing.assert_close(got, want["d"], rtol=1e-5, atol=1e-6)
    assert store.readers("org/d")[0].startswith("lora_pin-load")
    with pytest.raises(AdapterNotFoundError, match="missing"):
        mgr.prepare_step(["org/d", "missing"], 1)
    run_one(mgr, model, None)  # no step was left active
    mgr.registry.audit()


def test_batch_waits_for_its_reads_on_the_loader(linears_world: Any, want: Any) -> None:
    """``batch()`` must run whole: it waits for ``a``'s read, which runs on a loader thread."""
    mgr, model = evicted_world(linears_world)
    with slow_store(delay_ms=20) as store, torch.no_grad(), mgr.batch(["a"]):
        got = model(IDS).logits
    torch.testing.assert_close(got, want["a"], rtol=1e-5, atol=1e-6)
    assert store.readers("a")[0].startswith("lora_pin-load")


def test_batch_waits_for_room_held_by_prefetched_reads(linears_world: Any, want: Any) -> None:
    """Every place in the host tier is set aside for a prefetched read when ``batch(["d"])`` begins (``d``
    is out of host memory): it waits for those reads to end, then has ``d`` read, still on a loader
    thread."""
    _, paths = linears_world
    mgr, model = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=3)
    for name in "abcdefg":
        mgr.load(name, paths[name])  # e, f, g resident
    with slow_store(delay_ms=200) as store:
        assert mgr.prefetch(["a", "b", "c"]) == ["a", "b", "c"]
        assert mgr.registry.stats()["host"]["fetching"] == ["a", "b", "c"]
        with torch.no_grad(), mgr.batch(["d"]):
            got = model(IDS).logits
        assert mgr.wait_loads(timeout=30)
    torch.testing.assert_close(got, want["d"], rtol=1e-5, atol=1e-6)
    assert all(thread.startswith("lora_pin-load") for _, thread in store.reads), store.reads
    mgr.registry.audit()


def test_split_reads_the_later_groups_while_the_first_runs(linears_world: Any) -> None:
    """``split`` prefetches the groups after the first once the first group's step has begun: read
    before, they would evict the first group's adapters from a small host tier."""
    _, paths = linears_world
    mgr, model = manager(linears_world, max_loras_per_batch=2, max_loaded_loras=3)
    for name in "abcde":
        mgr.load(name, paths[name])  # a and b are out of host memory
    names: list[str | None] = ["c", "d", "a", "b"]
    with slow_store() as store:
        groups = mgr.split(names)
        assert groups == [[0, 1], [2, 3]]
        assert store.reads == []
        with torch.no_grad(), mgr.batch([names[i] for i in groups[0]]):
            model(IDS.expand(2, -1))
        assert mgr.wait_loads(timeout=30)
        assert [n for n, _ in store.reads] == ["a"]  # e made room for a; c and d ran: b waits
        with torch.no_grad(), mgr.batch([names[i] for i in groups[1]]):
            model(IDS.expand(2, -1))
    assert sorted(n for n, _ in store.reads) == ["a", "b"]
    assert all(thread.startswith("lora_pin-load") for _, thread in store.reads)
    mgr.registry.audit()


def test_blocking_loading_reads_in_the_step(linears_world: Any, want: Any) -> None:
    """``loading="blocking"`` keeps the old behaviour: the step reads ``a`` itself and admits it."""
    mgr, model = evicted_world(linears_world, loading="blocking")
    with slow_store() as store:
        step, got = run_one(mgr, model, "a")
    assert step.admitted == (0,)
    torch.testing.assert_close(got, want["a"], rtol=1e-5, atol=1e-6)
    assert store.readers("a") == [threading.current_thread().name]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(loading="lazy"), "loading must be one of background, blocking"),
        (dict(load_workers=0), "load_workers must be an int of at least 1"),
        (dict(load_workers=True), "load_workers must be an int of at least 1"),
    ],
)
def test_bad_loading_options_are_refused(linears_world: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        manager(linears_world, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_over_background_loads_compute_what_they_should(linears_world: Any, want: Any) -> None:
    """On CUDA the slot copies run on a side stream that waits only for the slot's earlier readers:
    steps alternating over more adapters than slots (each a fresh copy into a slot the last step read)
    still compute each adapter's output."""
    _, paths = linears_world
    base, _ = linears_world
    model = copy.deepcopy(base).cuda()
    mgr = LoRAManager(
        model,
        [f"{n}={paths[n]}" for n in "abcd"],
        max_loras_per_batch=2,
        max_lora_rank=4,
        lora_target_modules=TARGETS,
    )
    ids = IDS.cuda()
    for name in "abcdabcd":
        step = mgr.prepare_step([name], [ids.shape[1]])
        with torch.no_grad():
            got = model(ids).logits
        mgr.finish(step)
        torch.testing.assert_close(got.cpu(), want[name], rtol=1e-4, atol=1e-5)


def test_the_async_loading_benchmark_runs(
    capsys: pytest.CaptureFixture[str], load_bench: Callable[[str], Any]
) -> None:
    """``benches/async_loading.py`` stays runnable (a tiny run: its figures mean nothing here)."""
    module = load_bench("async_loading")
    argv = ["--requests", "40", "--rate", "2000", "--delay-ms", "5", "--rounds", "1", "--hidden", "64"]
    module.main(argv)
    out = capsys.readouterr().out
    assert "step p99 against no misses" in out and "0 requests failed" in out
    assert all(config in out for config in ("blocking", "background", "no misses"))
