"""The read pool's threads at shutdown: an idle worker holds nothing its last read returned, and
``close()`` returns only once the idle workers have ended.

Why it matters: a daemon thread still ending while the interpreter shuts down, and freeing a tensor then,
is torn down in the middle of torch's deallocator and the process aborts ("terminate called without an
active exception"). It happened to TP ranks that exited right after ``detach()``.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

from lora_pin.model.read_pool import ReadJob, ReadPool

# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120


class _Payload:
    """Stands for what a read returns (an adapter's tensors): only its lifetime matters here."""


def test_an_idle_worker_keeps_nothing_of_its_last_read() -> None:
    pool = ReadPool(workers=1, timeout=30.0)
    payload = _Payload()
    alive = weakref.ref(payload)
    box: list[Any] = [payload]
    del payload
    assert pool.submit(ReadJob("a", 1), lambda: box.pop(), None)
    assert pool.wait(timeout=HANG_GUARD_S)
    done = pool.take()
    assert [c.job for c in done] == [ReadJob("a", 1)] and done[0].adapter is not None
    del done
    gc.collect()
    assert alive() is None, "the idle worker still holds what its read returned"
    pool.close()


def test_close_returns_once_the_idle_workers_have_ended() -> None:
    pool = ReadPool(workers=2, timeout=30.0)
    workers: list[threading.Thread] = []
    for i in range(2):
        pool.submit(ReadJob(f"a{i}", 1), lambda: workers.append(threading.current_thread()), None)
    assert pool.wait(timeout=HANG_GUARD_S)
    assert workers, "no read ran"
    pool.close(grace=HANG_GUARD_S)
    assert [t.name for t in workers if t.is_alive()] == []


def test_close_does_not_wait_for_a_stuck_read() -> None:
    pool = ReadPool(workers=1, timeout=600.0)
    release = threading.Event()
    started = threading.Event()

    def stuck() -> None:
        started.set()
        release.wait()

    pool.submit(ReadJob("a", 1), stuck, None)
    assert started.wait(HANG_GUARD_S)
    ended = threading.Event()
    # The read is let go only after close() returned, and close() is given more grace than the test
    # waits: a close() that waited for the running read could only return by the test's failing.
    closer = threading.Thread(target=lambda: (pool.close(grace=10 * HANG_GUARD_S), ended.set()))
    closer.start()
    try:
        assert ended.wait(HANG_GUARD_S), "close() waited for a running read"
    finally:
        release.set()
        closer.join(HANG_GUARD_S)
