"""What becomes of each request of a step: the core sees every request and says why each one that does not
run waits or fails; requests whose adapter was unloaded while they waited fail alone; ``adapter_dir``
adapters wait for host room instead of failing."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

from lora_pin import AdapterNotFoundError, CapacityError, LoRAManager, SpecError, UsageError

TARGETS = ["q_proj", "v_proj"]
IDS = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(5))


def manager(qv_world: Any, **kwargs: Any) -> tuple[LoRAManager, torch.nn.Module]:
    base, _ = qv_world
    model = copy.deepcopy(base)
    kwargs.setdefault("max_lora_rank", 4)
    kwargs.setdefault("lora_target_modules", TARGETS)
    return LoRAManager(model, **kwargs), model


def logits_of(qv_world: Any, name: str) -> torch.Tensor:
    """``name``'s logits on ``IDS`` from a manager of its own (the per-sequence path)."""
    _, paths = qv_world
    mgr, model = manager(qv_world, lora_paths=[f"{name}={paths[name]}"], loading="blocking")
    with torch.no_grad(), mgr.batch([name]):
        return model(IDS).logits


@pytest.mark.parametrize("loading", ["background", "blocking"])
def test_requests_of_an_unloaded_adapter_fail_and_the_rest_run(qv_world: Any, loading: str) -> None:
    _, paths = qv_world
    mgr, model = manager(qv_world, lora_paths=[f"a={paths['a']}", f"b={paths['b']}"], loading=loading)
    mgr.unload("b")  # its requests are still in the scheduler's queue
    step = mgr.prepare_step(["b", "a", "b"], [5, 5, 5])
    try:
        with torch.no_grad():
            out = model(IDS).logits
    finally:
        mgr.finish(step)
    assert step.admitted == (1,) and step.deferred == ()
    assert sorted(step.failed) == [0, 2]
    for error in step.failed.values():
        assert isinstance(error, AdapterNotFoundError) and "unloaded" in str(error)
    torch.testing.assert_close(out, logits_of(qv_world, "a"))
    with pytest.raises(AdapterNotFoundError), mgr.batch(["a", "b"]):
        pass  # a batch runs whole


def test_each_deferred_request_says_why(qv_world: Any) -> None:
    _, paths = qv_world
    mgr, _ = manager(qv_world, lora_paths=[f"{n}={paths[n]}" for n in "abc"], max_loras_per_batch=2)
    mgr.load("d", paths["d"])
    mgr.registry.unload("d")  # the manager's tensors stay; only the core forgets it
    step = mgr.prepare_step(["a", "b", "c", None], 1)
    mgr.finish(step)
    assert step.admitted == (0, 1, 3) and step.deferred == (2,)
    assert step.reasons == ("device_room",) and step.loading == ()


def test_an_adapter_dir_adapter_waits_for_host_room(qv_world: Any) -> None:
    """A discovery read while the host tier is full of pinned adapters waits for room (its requests are
    deferred as loading) and is served once a pin goes, instead of failing its requests."""
    _, paths = qv_world
    root = paths["a"].parent
    items = [f"{n}={paths[n]}" for n in "abc"]
    probe, _ = manager(qv_world, lora_paths=items)
    full = probe.stats()["host_bytes"]  # a, b and c fill the host tier; e is as large as each
    mgr, model = manager(
        qv_world, lora_paths=items, max_loras_per_batch=4, max_host_bytes=full, adapter_dir=root
    )
    for name in "abc":
        mgr.pin(name)
    step = mgr.prepare_step(["e"], [5])
    mgr.finish(step)
    assert step.deferred == step.loading == (0,) and not step.failed
    assert mgr.wait_loads(timeout=30)
    for _ in range(3):
        step = mgr.prepare_step(["e"], [5])
        mgr.finish(step)
        assert not step.failed, step.failed
        assert step.deferred == step.loading == (0,) and step.reasons == ("loading",)
    mgr.unpin("a")
    mgr.finish(mgr.prepare_step([None], 1))  # installs e in a's place
    step = mgr.prepare_step(["e"], [5])
    try:
        with torch.no_grad():
            out = model(IDS).logits
    finally:
        mgr.finish(step)
    assert step.admitted == (0,)
    torch.testing.assert_close(out, logits_of(qv_world, "e"))


@pytest.mark.parametrize("loading", ["background", "blocking"])
def test_a_batch_that_can_never_have_its_adapters_in_host_memory_is_refused_not_retried(
    qv_world: Any, loading: str
) -> None:
    """Host memory for one and a half adapters: a batch of a and b can never have both there, so no
    round of reading first or waiting for reads brings it closer. The step path ends, as the core's
    answers say (a read-first list that does not shrink, a fetching answer without progress), and the
    batch is refused with nothing of it run. A guard only: the thread ends long before it."""
    _, paths = qv_world
    nbytes = manager(qv_world, lora_paths=[f"a={paths['a']}"])[0].host["a"].nbytes
    mgr, _ = manager(qv_world, max_loras_per_batch=2, max_host_bytes=nbytes * 3 // 2, loading=loading)
    for name in "ab":
        mgr.load(name, paths[name])  # b evicts a
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            with mgr.batch(["a", "b"]):
                pass
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "beginning the batch never ended"
    assert len(outcome) == 1 and isinstance(outcome[0], CapacityError), outcome
    assert mgr.registry.in_flight("a") == mgr.registry.in_flight("b") == 0
    mgr.registry.audit()


def test_no_waiting_request_with_an_adapter_starts_after_one_deferred_for_a_slot(qv_world: Any) -> None:
    """The core's rule an engine starts requests by (``LoRAManager.startable``): after a waiting request
    deferred for want of a slot, later waiting ones that need an adapter wait too; base-model ones and
    running ones go on."""
    _, paths = qv_world
    mgr, _ = manager(qv_world, lora_paths=[f"{n}={paths[n]}" for n in "abc"], max_loras_per_batch=2)
    step = mgr.prepare_step(["a", "b", "c", None, "a"], 1)
    try:
        assert (step.admitted, step.deferred, step.reasons) == ((0, 1, 3, 4), (2,), ("device_room",))
        assert mgr.startable(step, [False, True, True, True, True]) == [0, 1, 3]
        assert mgr.startable(step, [False, True, True, True, False]) == [0, 1, 3, 4]
        assert mgr.startable(step, [True, True, False, True, True]) == [0, 1, 3, 4]
        with pytest.raises(UsageError, match="waiting flags"):
            mgr.startable(step, [True])
        # Longest remaining first holds nothing back: its overtaking is bounded by the age bound.
        assert mgr.startable(step, [False, True, True, True, True], order="longest_remaining") == [0, 1, 3, 4]
        with pytest.raises(SpecError, match="admission order"):
            mgr.startable(step, [False, True, True, True, True], order="fifo")
    finally:
        mgr.finish(step)
