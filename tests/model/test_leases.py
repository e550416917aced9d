"""The one drain: a manager's leases (a server's requests from acceptance to their last output) hold an
unload or a replacement back, through the manager's public API alone.

Every outcome is read from what the manager reports (its leases, its registry membership, identities);
a wait is bounded only by a guard far past any busy machine, never decided by it.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch

from lora_pin import AdapterBusyError, AdapterNotFoundError, LoRAManager
from lora_pin.model.leases import RequestLeases

# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120

World = tuple[torch.nn.Module, dict[str, Path]]


def manager(world: World) -> LoRAManager:
    model, adapters = world
    items = [f"{n}={adapters[n]}" for n in "ab"]
    return LoRAManager(copy.deepcopy(model), items, max_loras_per_batch=2)


async def until(condition: object) -> None:
    """Yield to the loop until ``condition()`` holds (bounded by the hang guard)."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0)


def test_an_unload_waits_for_the_leases_with_the_adapter_still_registered(qv_world: World) -> None:
    mgr = manager(qv_world)

    async def run() -> None:
        lease = await mgr.leases.acquire("a")
        assert lease is not None and lease.digest == mgr.identity("a").digest
        base = await mgr.leases.acquire(None)
        assert base is not None and mgr.leases.outstanding() == {"a": 1, None: 1}
        unload = asyncio.create_task(mgr.unload_async("a", timeout=HANG_GUARD_S))
        await until(lambda: not mgr.leases.serves("a"))
        # Closed to new requests, yet registered: a queued request of its still runs its steps.
        assert await mgr.leases.acquire("a") is None
        assert "a" in mgr and not unload.done()
        with mgr.batch(["a"]) as step:
            assert step.admitted == (0,)
        with pytest.raises(AdapterNotFoundError, match="being unloaded"):
            await mgr.unload_async("a")
        lease.release()
        lease.release()  # idempotent
        await unload
        assert "a" not in mgr and mgr.leases.outstanding() == {None: 1}
        base.release()

    asyncio.run(run())
    assert mgr.leases.outstanding() == {}


def test_an_unload_whose_leases_outlast_the_timeout_changes_nothing(qv_world: World) -> None:
    mgr = manager(qv_world)

    async def run() -> None:
        lease = await mgr.leases.acquire("b")
        assert lease is not None
        with pytest.raises(AdapterBusyError, match="1 requests"):
            await mgr.unload_async("b", timeout=0)
        assert "b" in mgr and mgr.leases.serves("b")
        again = await mgr.leases.acquire("b")
        assert again is not None
        lease.release()
        again.release()
        await mgr.unload_async("b", timeout=HANG_GUARD_S)
        assert "b" not in mgr and not mgr.leases.serves("b")

    asyncio.run(run())


def test_a_replacement_holds_new_leases_back_until_the_old_ones_end(qv_world: World) -> None:
    mgr = manager(qv_world)
    _, adapters = qv_world
    old = mgr.identity("a").digest

    async def run() -> None:
        lease = await mgr.leases.acquire("a")
        assert lease is not None
        replace = asyncio.create_task(mgr.load_async("a", adapters["c"], replace=True, timeout=HANG_GUARD_S))
        await until(lambda: "a" in mgr.leases._replacing)
        held = asyncio.create_task(mgr.leases.acquire("a"))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not held.done() and not replace.done() and mgr.identity("a").digest == old
        lease.release()
        await replace
        new = await held
        assert new is not None and new.digest == mgr.identity("a").digest != old
        assert lease.digest == old
        new.release()

    asyncio.run(run())


def test_a_replacement_whose_leases_outlast_the_timeout_keeps_the_old_weights(qv_world: World) -> None:
    mgr = manager(qv_world)
    _, adapters = qv_world
    old = mgr.identity("a").digest

    async def run() -> None:
        lease = await mgr.leases.acquire("a")
        assert lease is not None
        with pytest.raises(AdapterBusyError, match="replacement"):
            await mgr.load_async("a", adapters["c"], replace=True, timeout=0)
        assert mgr.identity("a").digest == old and "a" not in mgr.leases._replacing
        later = await mgr.leases.acquire("a")
        assert later is not None and later.digest == old
        lease.release()
        later.release()

    asyncio.run(run())


def test_leases_without_a_manager_serve_the_base_alone() -> None:
    leases = RequestLeases()

    async def run() -> None:
        assert await leases.acquire("x") is None and not leases.serves("x") and not leases.close("x")
        lease = await leases.acquire(None)
        assert lease is not None and lease.name is None and leases.outstanding() == {None: 1}
        lease.release()

    asyncio.run(run())
    assert leases.outstanding() == {}
