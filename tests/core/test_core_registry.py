"""The Rust registry through its Python face: errors, plan buffers, unload (blocking, timed out,
asyncio), and an 8-thread stress test that must finish without deadlock."""

from __future__ import annotations

import asyncio
import random
import threading
import warnings

import pytest
import torch

from lora_pin._core import LoRARef, LoRARegistry, StepPlan
from lora_pin.errors import (
    AdapterInUseError,
    AdapterNotFoundError,
    CapacityError,
    DuplicateAdapterError,
    SpecError,
    UnloadTimeoutError,
    UsageError,
)
from lora_pin.unloading import unload_async

# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120


def make(slots: int = 2, loaded: int | None = None, names: str = "abc", **kw: object) -> LoRARegistry:
    reg = LoRARegistry(slots, loaded, **kw)  # type: ignore[arg-type]
    for i, n in enumerate(names):
        reg.register(LoRARef(n, f"/srv/{n}"), rank=4 + i, host_bytes=100, device_bytes=50, scaling=0.5)
    return reg


def run(reg: LoRARegistry, names: list[str | None], num_tokens: list[int]) -> StepPlan:
    """One step transaction: begun, its loads reported done, finished; returns its plan."""
    plan = reg.begin_step(names, num_tokens)
    for index in range(len(plan.loads)):
        reg.report_load(plan.ticket, index, True)  # type: ignore[arg-type]
    reg.finish_step(plan.ticket)  # type: ignore[arg-type]
    return plan


def tensor(buf: bytearray, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)


def test_plan_buffers_become_tensors_without_a_warning() -> None:
    reg = make(chunk_size=2)
    plan = run(reg, ["a", None, "b", "a"], [2, 1, 3, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        i32 = {k: tensor(getattr(plan, k), torch.int32).tolist() for k in ("request_slots", "token_perm")}
        indptr = torch.frombuffer(plan.seg_indptr, dtype=torch.int32)
        scalings = torch.frombuffer(plan.slot_scalings, dtype=torch.float32)
        epochs = torch.frombuffer(plan.slot_epochs, dtype=torch.int64)
    assert i32 == {"request_slots": [0, -1, 1, 0], "token_perm": [0, 1, 6, 3, 4, 5]}
    assert indptr.tolist() == [0, 2, 3, 5, 6]
    assert tensor(plan.seg_slots, torch.int32).tolist() == [0, 0, 1, 1]
    assert tensor(plan.slot_ranks, torch.int32).tolist() == [4, 5]
    assert scalings.tolist() == [0.5, 0.5] and epochs.tolist() == [1, 1]
    assert plan.num_tokens == 7 and plan.admitted == [0, 1, 2, 3] and plan.deferred == []
    assert [(n, s, src) for n, _, s, src in plan.loads] == [("a", 0, "host"), ("b", 1, "host")]
    assert plan.loads[0][1] == LoRARef("a", "/srv/a").lora_id
    assert isinstance(plan, StepPlan) and "loads=2" in repr(plan)


def test_an_all_base_step_has_empty_adapter_buffers() -> None:
    plan = run(make(), [None, None], [3, 1])
    assert plan.admitted == [0, 1] and plan.token_perm == bytearray() and plan.seg_slots == bytearray()
    assert tensor(plan.seg_indptr, torch.int32).tolist() == [0]


def test_errors_are_the_documented_classes_and_name_the_values() -> None:
    reg = make()
    with pytest.raises(DuplicateAdapterError, match=r"/srv/a.*/srv/a"):
        reg.register(LoRARef("a", "/srv/a"), rank=8, host_bytes=1, device_bytes=1)
    with pytest.raises(AdapterNotFoundError, match=r'"zz".*registered: "a", "b", "c"') as info:
        reg.begin_step(["a", "zz"], 1)
    assert isinstance(info.value, KeyError) and reg.in_flight("a") == 0
    reg.pin("a")
    with pytest.raises(CapacityError, match="max_loras_per_batch=2 allows at most 1 pinned"):
        reg.pin("b")
    with pytest.raises(UsageError, match="2 adapter names but 1 token counts"):
        reg.begin_step(["a", "b"], [1])
    with pytest.raises(UsageError, match=r"names\[1\] must be an adapter name"):
        reg.begin_step(["a", 3], [1, 1])  # type: ignore[list-item]
    with pytest.raises(UsageError, match=r"num_tokens\[0\] must be in"):
        reg.begin_step(["a"], [-1])
    ticket = reg.begin_step(["a"], 1).ticket
    assert ticket is not None
    with pytest.raises(UsageError, match="not pending"):
        reg.report_load(ticket, 5, True)
    with pytest.raises(UsageError, match=f"step {ticket} is open"):
        reg.begin_step(["a"], 1)
    reg.finish_step(ticket)
    with pytest.raises(UsageError, match="finished already"):
        reg.finish_step(ticket)
    with pytest.raises(SpecError, match="rank must be in"):
        reg.register(LoRARef("d", "/d"), rank=0, host_bytes=1, device_bytes=1)
    with pytest.raises(SpecError, match='"lfu" is not an eviction policy'):
        LoRARegistry(2, eviction_policy="lfu")
    with pytest.raises(SpecError, match="max_loaded_loras=1 must be >= max_loras_per_batch=2"):
        LoRARegistry(2, 1)


def test_stats_and_repr_show_the_tiers() -> None:
    reg = make(2, 3, names="abcd", eviction_policy="fifo")
    reg.pin("b")
    run(reg, ["b", "c", "d"], [1, 1, 1])
    s = reg.stats()
    assert s["registered"] == 4 and s["pinned"] == 1
    assert s["host"]["resident"] == ["b", "c", "d"] and s["host"]["evictions"] == 1
    assert s["device"]["resident"] == ["b", "c"] and s["device"]["pinned"] == ["b"]
    assert s["device"]["refusals"] == 1 and s["device"]["misses"] == 2
    assert repr(reg) == (
        "LoRARegistry(registered=4, pinned=1, unloading=0, host=3/3 adapters, device=2/2 slots, "
        "policies=fifo/lru)"
    )
    assert len(reg) == 4 and "a" in reg and "x" not in reg and reg.lora_ref("b").pinned
    reg.audit()


def test_unload_blocks_until_released_then_is_idempotent() -> None:
    reg = make()
    ticket = reg.begin_step(["a", None, "a"], 1).ticket  # the open step holds a's two requests
    with pytest.raises(UnloadTimeoutError, match=r'"a" timed out.*2 request'):
        reg.unload("a", timeout=0.05)
    assert "a" not in reg and reg.in_flight("a") == 2
    with pytest.raises(AdapterInUseError):
        reg.register(LoRARef("a", "/srv/a"), rank=8, host_bytes=1, device_bytes=1)
    # Finished on another thread, most likely while this one waits (before it does, the outcome is the
    # same); the timeout only guards against a hang: an unload that missed the finish fails at it.
    threading.Timer(0.05, reg.finish_step, args=(ticket,)).start()
    reg.unload("a", timeout=HANG_GUARD_S)
    assert reg.stats()["unloading"] == []
    reg.unload("a")
    with pytest.raises(AdapterNotFoundError):
        reg.unload("never")
    reg.register(LoRARef("a", "/srv/a"), rank=8, host_bytes=1, device_bytes=1)
    reg.audit()


def test_asyncio_unload_while_in_use_does_not_block_the_loop() -> None:
    reg = make()
    ticket = reg.begin_step(["b"], 1).ticket

    async def scenario() -> list[str]:
        events: list[str] = []

        async def finish_request() -> None:
            for _ in range(5):
                await asyncio.sleep(0.01)
                events.append("tick")
            reg.finish_step(ticket)  # type: ignore[arg-type]
            events.append("released")

        unload = asyncio.create_task(unload_async(reg, "b", timeout=HANG_GUARD_S))
        await asyncio.sleep(0)
        assert "b" not in reg
        await finish_request()
        await unload
        events.append("unloaded")
        with pytest.raises(UnloadTimeoutError):
            reg.begin_step(["c"], 1)
            await unload_async(reg, "c", timeout=0.02)
        return events

    events = asyncio.run(scenario())
    assert events == ["tick"] * 5 + ["released", "unloaded"]


def test_eight_threads_of_random_operations_keep_the_invariants() -> None:
    reg = LoRARegistry(4, 8, chunk_size=4)
    names = [f"n{i}" for i in range(12)]
    errors: list[BaseException] = []
    expected = (AdapterNotFoundError, DuplicateAdapterError, CapacityError, AdapterInUseError, UsageError)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[int] = []  # the ticket of the step this thread holds open, if any
        try:
            for _ in range(400):
                name = rng.choice(names)
                op = rng.randrange(8)
                try:
                    if op == 0:
                        reg.register(LoRARef(name, f"/p/{name}"), rank=8, host_bytes=1, device_bytes=1)
                    elif op == 1 and not held:
                        # Held open while this thread goes on: its requests are in flight meanwhile.
                        held.append(reg.begin_step([name if name in reg else None], 1).ticket)  # type: ignore[arg-type]
                    elif op == 2 and held:
                        reg.finish_step(held.pop())
                    elif op == 3:
                        reg.pin(name)
                    elif op == 4:
                        reg.unpin(name)
                    elif op == 5:
                        reg.try_unload(name)
                    else:
                        batch = [rng.choice([*names, None]) for _ in range(16)]
                        run(reg, [n for n in batch if n is None or n in reg], [1] * 16)
                except expected:
                    pass
            for ticket in held:
                reg.finish_step(ticket)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads), "a thread is stuck: deadlock"
    assert not errors, errors
    reg.audit()
    assert all(reg.in_flight(n) == 0 for n in names if n in reg)
