"""Background reads that hang, fail or can never fit: a read has a deadline and an abandoned read gives
back its place (its host reservation and its worker); a read that fails evicts no other adapter; a pin
that would leave a registered adapter no room in the host tier is refused; a serving loop can wait for
the next read instead of spinning.

A hung read is a read of an adapter that blocks on an ``Event`` (or, in the subprocess, on opening a
FIFO no one writes to) until the test lets it go: a stand-in for a hung network mount.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import AdapterLoadError, CapacityError, LoRAManager, LoRARef, SpecError
from lora_pin.model import read_pool
from lora_pin.weights import HostTier

TARGETS = ["q_proj", "v_proj"]
IDS = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(5))
# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120


def manager(qv_world: Any, **kwargs: Any) -> tuple[LoRAManager, Any]:
    base, _ = qv_world
    model = copy.deepcopy(base)
    kwargs.setdefault("max_lora_rank", 4)
    kwargs.setdefault("lora_target_modules", TARGETS)
    return LoRAManager(model, **kwargs), model


def evicted_world(qv_world: Any, **kwargs: Any) -> LoRAManager:
    """A manager whose host tier (two places) holds b and c, both in device slots: a was evicted."""
    _, paths = qv_world
    mgr, _ = manager(qv_world, max_loras_per_batch=2, max_loaded_loras=2, **kwargs)
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


class HungReads:
    """The reads :func:`hung_reads` holds: each blocks until :meth:`release` (or the block's exit)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = threading.Event()
        # The threads that entered a hung read, in order.
        self.readers: list[threading.Thread] = []

    def release(self) -> None:
        self.released.set()

    def wait_entered(self) -> None:
        """Block until a hung read has begun (a worker took it up and is stuck in it)."""
        assert self.entered.wait(HANG_GUARD_S), "no hung read began"


@contextlib.contextmanager
def hung_reads(*names: str, times: int = 1) -> Iterator[HungReads]:
    """The first ``times`` reads of each of ``names`` block until released (on exit at the latest);
    other reads run as usual."""
    hung = HungReads()
    left = dict.fromkeys(names, times)
    original = HostTier.read

    def read(self: HostTier, name: str, path: Any, **kwargs: Any) -> Any:
        if left.get(name, 0) > 0:
            left[name] -= 1
            hung.readers.append(threading.current_thread())
            hung.entered.set()
            hung.released.wait()
        return original(self, name, path, **kwargs)

    HostTier.read = read  # type: ignore[method-assign]
    try:
        yield hung
    finally:
        HostTier.read = original  # type: ignore[method-assign]
        hung.release()


class JumpingClock:
    """The read pool's clock (its ``time.monotonic``), moved forward when a test says: a read's
    deadline passes at a point of the test's choosing, never at whatever point a busy machine reaches."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def jump(self, seconds: float) -> None:
        self.ahead += seconds


@pytest.fixture
def pool_clock(monkeypatch: pytest.MonkeyPatch) -> JumpingClock:
    clock = JumpingClock()
    monkeypatch.setattr(read_pool, "time", clock)
    return clock


# ---- item 3: a failed read evicts no one ------------------------------------------------------------


def test_a_failed_background_read_evicts_no_other_adapter(qv_world: Any, tmp_path: Path) -> None:
    """a's files broke after it left host memory; its background read fails. b and c, which the host
    tier would have evicted to make room for it, stay in both tiers: room is made only once a read has
    succeeded."""
    _, paths = qv_world
    mgr, _ = manager(qv_world, max_loras_per_batch=2, max_loaded_loras=2)
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
    assert mgr.wait_loads(timeout=HANG_GUARD_S)
    got = step(mgr, ["a", None])
    assert list(got.failed) == [0] and isinstance(got.failed[0], AdapterLoadError)
    assert places(mgr) == before
    stats = mgr.stats()
    assert stats["host_bytes"] == stats["host"]["bytes"] and stats["host"]["reserved_bytes"] == 0
    mgr.registry.audit()


def test_a_read_that_succeeds_makes_its_room_when_it_is_installed(qv_world: Any) -> None:
    """The counterpart: a's read succeeds, and the least recently used adapter leaves for it then."""
    mgr = evicted_world(qv_world)
    step(mgr, ["c"])
    assert step(mgr, ["a"]).loading == (0,)
    assert places(mgr) == (["b", "c"], ["b", "c"])
    assert mgr.wait_loads(timeout=HANG_GUARD_S)
    assert step(mgr, ["a"]).admitted == (0,)
    assert places(mgr)[0] == ["a", "c"]
    assert "b" not in mgr.host
    mgr.registry.audit()


# ---- item 5: every registered adapter fits beside the pinned ones -------------------------------------


def test_a_pin_that_would_leave_an_adapter_no_host_room_is_refused(qv_world: Any) -> None:
    """Host memory for two and a half adapters: with b and c pinned, a could never enter it again and
    its requests would wait for ever, so pinning c is refused with the numbers, and a is served."""
    _, paths = qv_world
    nbytes = manager(qv_world, lora_paths=[f"a={paths['a']}"])[0].host["a"].nbytes
    mgr, _ = manager(qv_world, max_loras_per_batch=3, max_host_bytes=nbytes * 5 // 2)
    for name in "abc":
        mgr.load(name, paths[name])  # c evicts a
    mgr.pin("b")
    with pytest.raises(CapacityError) as refused:
        mgr.pin("c")
    message = str(refused.value)
    assert '"a"' in message and f"max_host_bytes={nbytes * 5 // 2}" in message, message
    assert mgr.registry.stats()["pinned_names"] == ["b"]
    assert step(mgr, ["a"]).loading == (0,)
    assert mgr.wait_loads(timeout=HANG_GUARD_S)
    assert step(mgr, ["a"]).admitted == (0,)
    # Nor may an adapter be registered that could never enter beside the pins.
    with pytest.raises(CapacityError, match="could never enter the host tier beside them"):
        mgr.registry.register(LoRARef.new("big", "/srv/big"), rank=4, host_bytes=2 * nbytes, device_bytes=1)
    mgr.registry.audit()


# ---- item 2: deadlines ------------------------------------------------------------------------------


def test_a_hung_read_fails_its_requests_at_the_deadline_and_gives_its_place_back(
    qv_world: Any, pool_clock: JumpingClock
) -> None:
    """One loader thread, a's read hangs: past ``load_timeout`` a's requests fail naming the adapter,
    its path and the deadline; its host reservation is released; a replacement thread reads d; a later
    request for a reads it again; the hung read's late result is discarded, never installed.

    The read pool's clock jumps past a's deadline once a's read has begun: no other read comes near the
    minute it is given, however slow the machine."""
    _, paths = qv_world
    mgr = evicted_world(qv_world, load_workers=1, load_timeout=60)
    mgr.load("d", paths["d"])  # evicts b
    with hung_reads("a") as hung:
        assert step(mgr, ["a"]).loading == (0,)
        assert mgr.registry.stats()["host"]["fetching"] == ["a"]
        hung.wait_entered()
        pool_clock.jump(61)
        got = step(mgr, ["a", None])
        assert list(got.failed) == [0] and got.admitted == (1,)
        error = got.failed[0]
        assert isinstance(error, AdapterLoadError)
        assert "'a'" in str(error) and str(paths["a"]) in str(error) and "load_timeout=60" in str(error)
        host = mgr.registry.stats()["host"]
        assert host["fetching"] == [] and host["reserved_bytes"] == 0
        assert mgr._loads.pool.abandoned == 1
        # The only worker is stuck in a's read: b is read by the thread that replaced it.
        assert step(mgr, ["b"]).loading == (0,)
        assert mgr.wait_loads(timeout=HANG_GUARD_S)
        assert step(mgr, ["b"]).admitted == (0,)
        assert mgr.stats()["loads_in_flight"] == 0
        hung.release()
    # The abandoned read returns its adapter once let go, and its thread then ends: dropped by now.
    [reader] = hung.readers
    reader.join(HANG_GUARD_S)
    assert not reader.is_alive(), "the abandoned read never returned"
    assert "a" not in mgr.host
    again = step(mgr, ["a"])
    assert again.deferred == again.loading == (0,) and not again.failed, "the late result was installed"
    assert mgr.wait_loads(timeout=HANG_GUARD_S)
    assert step(mgr, ["a"]).admitted == (0,)
    assert mgr.stats()["background_load_failures"] == 1
    mgr.registry.audit()


def test_unloading_an_adapter_whose_read_hangs_frees_its_worker(qv_world: Any) -> None:
    """With one loader thread stuck in a's read, unloading a returns at once and later reads run."""
    mgr = evicted_world(qv_world, load_workers=1)
    with hung_reads("a") as hung:
        assert step(mgr, ["a"]).loading == (0,)
        hung.wait_entered()
        assert mgr.stats()["loads_in_flight"] == 1
        mgr.unload("a", timeout=HANG_GUARD_S)
        mgr.load("d", qv_world[1]["d"])  # evicts b
        assert step(mgr, ["b"]).loading == (0,)
        assert mgr.wait_loads(timeout=HANG_GUARD_S), "no thread left to read b"
        assert step(mgr, ["b"]).admitted == (0,)
    mgr.registry.audit()


def test_batch_returns_at_the_deadline_and_detach_works(qv_world: Any) -> None:
    """``batch()`` over an adapter whose read hangs raises at the deadline instead of blocking for
    ever, and the manager can then be detached. The read is held until the block ends, so its deadline
    passes for certain, however slow the machine."""
    mgr = evicted_world(qv_world, load_timeout=0.5)
    with hung_reads("a"):
        with pytest.raises(AdapterLoadError, match=r"load_timeout=0\.5"), mgr.batch(["a"]):
            pass
        mgr.detach()


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_bad_load_timeouts_are_refused(qv_world: Any, timeout: Any) -> None:
    with pytest.raises(SpecError, match="load_timeout must be a finite number of seconds above 0"):
        manager(qv_world, load_timeout=timeout)


def test_the_interpreter_exits_while_a_read_hangs(qv_world: Any, tmp_path: Path) -> None:
    """A read blocked in the kernel (opening a FIFO no one writes to) fails at the deadline, and the
    process still exits: no loader thread is one the interpreter joins at exit."""
    _, paths = qv_world
    fifo = tmp_path / "hang"
    os.mkfifo(fifo)
    script = textwrap.dedent(
        f"""
        import copy
        import torch
        from transformers import AutoModelForCausalLM
        from lora_pin import LoRAManager
        from lora_pin.fixtures import make_tiny_llama
        from lora_pin.weights import HostTier

        model = AutoModelForCausalLM.from_pretrained(make_tiny_llama({str(tmp_path / "base")!r}))
        mgr = LoRAManager(model, max_loras_per_batch=1, max_loaded_loras=1, max_lora_rank=4,
                          lora_target_modules={TARGETS!r}, load_timeout=0.5)
        mgr.load("a", {str(paths["a"])!r})
        mgr.load("b", {str(paths["b"])!r})
        original = HostTier.read

        def read(self, name, path, **kwargs):
            if name == "a":
                open({str(fifo)!r}).read()  # blocks: no writer
            return original(self, name, path, **kwargs)

        HostTier.read = read
        step = mgr.prepare_step(["a"], 1)
        mgr.finish(step)
        assert step.loading == (0,)
        # The read never ends: the wait returns once the loader abandons it at its deadline.
        assert mgr.wait_loads(timeout=60)
        step = mgr.prepare_step(["a"], 1)
        mgr.finish(step)
        print("failed:", type(step.failed[0]).__name__, flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed: AdapterLoadError" in done.stdout


# ---- item 13: waiting for the next read ---------------------------------------------------------------


def test_wait_for_read_returns_when_a_read_ends(qv_world: Any) -> None:
    """A loop whose requests all wait for a read waits for it instead of spinning: ``wait_for_read``
    blocks while the read runs, returns once it ends, and at once when no read is in flight."""
    mgr = evicted_world(qv_world)
    assert mgr.wait_for_read(timeout=0)
    with hung_reads("a") as hung:
        got = step(mgr, ["a"])
        assert got.admitted == () and got.loading == (0,)
        # Held until released (the default deadline is minutes away): this wait can only time out.
        assert not mgr.wait_for_read(timeout=0.2)
        # Released by another thread, most likely while this one waits (before it does, the outcome is
        # the same); the timeout only guards against a hang.
        threading.Timer(0.2, hung.release).start()
        assert mgr.wait_for_read(timeout=HANG_GUARD_S)
    assert mgr.wait_for_read(timeout=0), "a finished read not installed yet returns at once"
    assert step(mgr, ["a"]).admitted == (0,)
    assert mgr.wait_for_read(timeout=0)
