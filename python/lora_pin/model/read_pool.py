"""The read pool: adapter reads on a small set of threads, each with a deadline, their ends queued.

:class:`ReadPool` knows nothing of the registry: it runs the read it is given for a :class:`ReadJob`,
remembers which jobs are in flight, so one job is never read twice at once, and queues each
:class:`Completion` in the order the reads end. A manager's :class:`~lora_pin.model.reads.BackgroundReads`
submits the reads and installs what they return.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lora_pin.errors import AdapterLoadError
from lora_pin.weights.host_adapter import HostAdapter

__all__ = ["Completion", "ReadJob", "ReadPool"]


@dataclass(frozen=True)
class ReadJob:
    """One background read.

    Attributes:
        name: the adapter.
        serial: the registration the read is for (a fetch of a registered adapter); None for a
            discovery (an ``adapter_dir`` adapter not registered yet, registered once read).
    """

    name: str
    serial: int | None


@dataclass(frozen=True)
class Completion:
    """A finished :class:`ReadJob`: the adapter read, or why not (``cancelled``: it never ran)."""

    job: ReadJob
    adapter: HostAdapter | None
    error: BaseException | None
    cancelled: bool = False


class _Run:
    """One submitted read: queued, then running on a worker until it ends or is abandoned."""

    __slots__ = ("abandoned", "job", "path", "read", "started")

    def __init__(self, job: ReadJob, read: Callable[[], HostAdapter], path: str | None) -> None:
        self.job, self.read, self.path = job, read, path
        self.started: float | None = None
        # Set (under the pool's lock) when its completion was queued without it: past its deadline,
        # or cancelled while running. Its worker was replaced; whatever the read returns is discarded.
        self.abandoned = False


class ReadPool:
    """Runs adapter reads on ``workers`` threads and queues their completions, in the order they finish.

    A read running longer than ``timeout`` seconds (a hung disk or network mount) is abandoned: it
    completes at once with an :class:`~lora_pin.errors.AdapterLoadError` naming the adapter, its path and
    the deadline, another thread takes its worker's place so later reads run, and whatever it returns
    if it ever ends is discarded. Deadlines are checked whenever the loader is asked anything, and
    waits wake up for them. The threads are daemons: a read stuck in the kernel never keeps the
    interpreter from exiting (``concurrent.futures`` joins its workers at exit).

    Args:
        workers: threads reading at once (at least 1).
        timeout: seconds a read may run (positive).

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, workers: int, timeout: float) -> None:
        self.workers = workers
        self.timeout = timeout
        # Guards everything below; waiters are woken on every completion and every submission.
        self._changed = threading.Condition()
        self._queued: deque[_Run] = deque()
        # Every run submitted and not completed (queued or running), by job.
        self._runs: dict[ReadJob, _Run] = {}
        self._done: list[Completion] = []
        # Workers not abandoned: idle, or running a read within its deadline.
        self._threads = 0
        self._started_threads = 0
        # Workers waiting for a read: close() joins them, so none is still ending (and freeing what
        # its last read held) while the interpreter shuts down, where a daemon thread that frees a
        # tensor is torn down mid-call and the process aborts.
        self._idle: set[threading.Thread] = set()
        self._closed = False
        self.abandoned = 0

    def submit(self, job: ReadJob, read: Callable[[], HostAdapter], path: str | None) -> bool:
        """Start ``read`` (of the adapter at ``path``) for ``job`` on a worker, unless the same job is in
        flight or its completion waits to be taken; returns whether it started.

        Raises:
            RuntimeError: the loader was closed.
        """
        with self._changed:
            if self._closed:
                raise RuntimeError("the read pool was closed")
            self._expire()
            if job in self._runs or any(c.job == job for c in self._done):
                return False
            run = _Run(job, read, path)
            self._runs[job] = run
            self._queued.append(run)
            self._staff()
            self._changed.notify_all()
        return True

    def busy(self, name: str) -> bool:
        """Whether a read of ``name`` is running, queued, or done and not yet taken."""
        with self._changed:
            self._expire()
            return any(j.name == name for j in self._runs) or any(c.job.name == name for c in self._done)

    def running(self) -> list[ReadJob]:
        """The jobs submitted and not finished yet, in submission order."""
        with self._changed:
            self._expire()
            return list(self._runs)

    def take(self) -> list[Completion]:
        """Every completion not taken yet, in the order the reads finished (never blocks)."""
        with self._changed:
            self._expire()
            done, self._done = self._done, []
        return done

    def idle(self) -> bool:
        """Whether no read is in flight and no completion waits to be taken, so :meth:`take` would
        return nothing. Read without the lock (each step asks): a read completing meanwhile is as one
        that ended just after, and a completion is queued in the same locked section that ends its run."""
        return not self._runs and not self._done

    def wait(self, names: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until no read of any of ``names`` (None: of any adapter) is running or queued; returns
        False on timeout. Completions stay queued for :meth:`take`. Returns by the reads' deadlines at
        the latest (an abandoned read completes).
        """
        wanted = None if names is None else set(names)
        return self._wait_until(
            lambda: not any(wanted is None or j.name in wanted for j in self._runs), timeout
        )

    def wait_any(self, timeout: float | None = None) -> bool:
        """Block until a completion waits to be taken (one may already), or no read is in flight;
        False on timeout."""
        return self._wait_until(lambda: bool(self._done) or not self._runs, timeout)

    def cancel(self, name: str) -> None:
        """End the reads of ``name`` (its adapter was unloaded): queued ones complete as ``cancelled``;
        a running one too, abandoned (its worker replaced, its result discarded)."""
        with self._changed:
            for run in [r for j, r in self._runs.items() if j.name == name]:
                if run.started is None:
                    self._queued.remove(run)
                else:
                    self._abandon(run)
                self._complete(run, Completion(run.job, None, None, cancelled=True))

    def close(self, grace: float = 10.0) -> None:
        """Cancel every read not started and stop the threads: the idle ones have ended when this
        returns (waiting at most ``grace`` seconds for them); a running one ends with its read (a stuck
        one is a daemon and never holds the interpreter)."""
        with self._changed:
            self._closed = True
            while self._queued:
                run = self._queued.popleft()
                self._complete(run, Completion(run.job, None, None, cancelled=True))
            self._changed.notify_all()
            idle = list(self._idle)
        end = time.monotonic() + grace
        for thread in idle:
            thread.join(max(end - time.monotonic(), 0.0))

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                self._expire()
                if done():
                    return True
                now = time.monotonic()
                if end is not None and now >= end:
                    return False
                # Wake up for the next deadline: nothing notifies when a read merely runs too long.
                deadlines = [r.started + self.timeout for r in self._runs.values() if r.started is not None]
                wake = [t - now for t in (end, min(deadlines, default=None)) if t is not None]
                self._changed.wait(max(min(wake), 0.0) if wake else None)

    def _expire(self) -> None:
        """Abandon every running read past its deadline (under the lock)."""
        now = time.monotonic()
        late = [r for r in self._runs.values() if r.started is not None and now - r.started > self.timeout]
        for run in late:
            self._abandon(run)
            error = AdapterLoadError(
                f"adapter {run.job.name!r}: reading {run.path or 'it'} did not finish within "
                f"load_timeout={self.timeout:g} s (a hung disk or network mount?); the read was abandoned "
                "and a later request reads it again"
            )
            self._complete(run, Completion(run.job, None, error))

    def _abandon(self, run: _Run) -> None:
        """Give up on ``run``, which a worker is running: that worker is replaced (under the lock)."""
        run.abandoned = True
        self.abandoned += 1
        self._threads -= 1
        self._staff()

    def _complete(self, run: _Run, completion: Completion) -> None:
        if self._runs.get(run.job) is run:
            del self._runs[run.job]
        self._done.append(completion)
        self._changed.notify_all()

    def _staff(self) -> None:
        """Start workers until there are ``workers``, or one per queued read (under the lock)."""
        while not self._closed and self._threads < min(self.workers, len(self._queued) + self._busy()):
            self._threads += 1
            self._started_threads += 1
            name = f"lora_pin-load-{self._started_threads}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _busy(self) -> int:
        return sum(1 for r in self._runs.values() if r.started is not None and not r.abandoned)

    def _work(self) -> None:
        me = threading.current_thread()
        with self._changed:
            while True:
                self._idle.add(me)
                while not self._queued and not self._closed:
                    self._changed.wait()
                self._idle.discard(me)
                if not self._queued:
                    self._threads -= 1
                    return
                run = self._queued.popleft()
                run.started = time.monotonic()
                self._changed.notify_all()  # waiters now have a deadline to wake up for
                self._changed.release()
                try:
                    completion = Completion(run.job, run.read(), None)
                except BaseException as exc:  # handed to the requests waiting on the adapter
                    completion = Completion(run.job, None, exc)
                finally:
                    self._changed.acquire()
                if run.abandoned:
                    return  # replaced already; what it read is discarded
                self._complete(run, completion)
                # An idle worker holds nothing: what the read held is freed now, by a live interpreter.
                del run, completion
