"""The background loader: adapter reads from disk on a small thread pool, off every step's path.

A step that needs an adapter which is not in host memory does not read it: it defers the requests
and hands the read to this loader. Reads run on ``workers`` threads; each finished read (or failure)
waits in a completion queue until the manager's next step installs it, under the residency lock,
so the host tier and the registry change only at a step's start, never under a running step.

:class:`BackgroundLoader` knows nothing of the registry: it runs the read it is given for a
:class:`LoadJob` and remembers which jobs are in flight, so one job is never read twice at once.
:class:`BackgroundLoads` ties it to a manager's registry and tensors.

With tensor parallelism every rank reads its own shards, and its reads end at times of their own; yet
every rank must install a read at the same step, or their registries (and so their plans) would part.
The fetches begun are the same on every rank, in the same order (the registry's plans and prefetches are
deterministic), so each install first agrees over the ranks on every fetch still open
(:meth:`~lora_pin.parallel.TensorParallelGroup.agree_fetches`): one read on every rank is installed; one
that failed on any rank fails on all (a rank whose own read succeeded drops its bytes); any other stays
open. A rank's finished reads wait for that agreement.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lora_pin._core import LoRARef
from lora_pin.errors import AdapterLoadError, CapacityError, DuplicateAdapterError, LoraPinError, SpecError
from lora_pin.model.residency import Residency
from lora_pin.parallel import Collective, TensorParallelGroup
from lora_pin.parallel.collective import READ, RUNNING, Agreement
from lora_pin.weights.host import HostAdapter

__all__ = [
    "DEFAULT_LOAD_TIMEOUT",
    "LOADING_MODES",
    "BackgroundLoader",
    "BackgroundLoads",
    "Completion",
    "LoadJob",
    "checked_load_timeout",
    "loading_mode",
]

#: How a manager reads adapters evicted from host memory (see :class:`~lora_pin.model.LoRAManager`).
LOADING_MODES = ("background", "blocking")

#: Seconds a background read may run before it is abandoned (``LoRAManager(load_timeout=...)``): well
#: past a 16 GiB weight file (the ``max_file_bytes`` default) at 100 MB/s, yet a hung mount fails its
#: requests within minutes instead of stopping all loading.
DEFAULT_LOAD_TIMEOUT = 300.0

#: Seconds an ``adapter_dir`` adapter, read, waits for host room (a host tier full of pinned, in-flight
#: or fetching adapters) before its requests fail with the ``CapacityError``: each step's install tries
#: to register it again, so a tier that is full only briefly makes its requests wait, not fail.
DISCOVERY_ROOM_WAIT_SECONDS = 60.0


@dataclass(frozen=True)
class LoadJob:
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
    """A finished :class:`LoadJob`: the adapter read, or why not (``cancelled``: it never ran)."""

    job: LoadJob
    adapter: HostAdapter | None
    error: BaseException | None
    cancelled: bool = False


class _Run:
    """One submitted read: queued, then running on a worker until it ends or is abandoned."""

    __slots__ = ("abandoned", "job", "path", "read", "started")

    def __init__(self, job: LoadJob, read: Callable[[], HostAdapter], path: str | None) -> None:
        self.job, self.read, self.path = job, read, path
        self.started: float | None = None
        # Set (under the loader's lock) when its completion was queued without it: past its deadline,
        # or cancelled while running. Its worker was replaced; whatever the read returns is discarded.
        self.abandoned = False


class BackgroundLoader:
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
        self._runs: dict[LoadJob, _Run] = {}
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

    def submit(self, job: LoadJob, read: Callable[[], HostAdapter], path: str | None) -> bool:
        """Start ``read`` (of the adapter at ``path``) for ``job`` on a worker, unless the same job is in
        flight or its completion waits to be taken; returns whether it started.

        Raises:
            RuntimeError: the loader was closed.
        """
        with self._changed:
            if self._closed:
                raise RuntimeError("the background loader was closed")
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

    def running(self) -> list[LoadJob]:
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


class BackgroundLoads:
    """One manager's background loading: starts the reads its steps and prefetches ask for, installs what
    they read into the host tier (:meth:`install`, at a step's start), and keeps each failure for the
    requests waiting on that adapter (:meth:`take_errors`).

    Args:
        residency: the manager's tensors and the registry they follow.
        workers: loader threads.
        timeout: seconds a read may run before it is abandoned (its requests fail).
        collective: the manager's :class:`~lora_pin.parallel.Collective`. Over tensor-parallel ranks
            installs agree over the ranks first (see the module's doc): fetches then begin, and installs
            and unloads run, in the same order on every rank, as every collective does, and discoveries
            are not available. On one process each read is installed as it ends.

    Thread safety: every method may be called from any thread; installs and error records change under
    ``residency.lock``.
    """

    def __init__(
        self,
        residency: Residency,
        workers: int,
        timeout: float = DEFAULT_LOAD_TIMEOUT,
        collective: Collective | None = None,
    ) -> None:
        self.residency = residency
        self.loader = BackgroundLoader(workers, timeout)
        # Ranks' reads end apart, so their installs wait for an agreement that one process needs not.
        self._group = collective if isinstance(collective, TensorParallelGroup) else None
        # With tp: the fetches begun and not agreed over yet, in the order they began (alike on every
        # rank), and this rank's finished reads of them, waiting for that agreement.
        self._open: dict[LoadJob, None] = {}
        self._ready: dict[LoadJob, Completion] = {}
        # Why the last background read of an adapter failed, with the registration it was for (None: a
        # discovery), until a step hands it to the requests for that adapter.
        self._errors: dict[str, tuple[int | None, LoraPinError]] = {}
        # Folder and confining root of each adapter_dir adapter being read before it is registered.
        self._folders: dict[str, tuple[Path, Path | None]] = {}
        # Fetches read whose adapter the host tier had no room for yet (its adapters all protected):
        # installed again at the next install.
        self._no_room: list[Completion] = []
        # Discoveries read but refused room by the host tier: each with the monotonic time it gives up,
        # and the refusal.
        self._room_waits: dict[str, tuple[Completion, float, CapacityError]] = {}
        self.failures = 0

    def start_fetches(self, to_fetch: Iterable[tuple[str, int]]) -> list[str]:
        """Read each ``(name, serial)`` the core has begun fetching; returns the names whose reads began
        (with ``tp``: every name, alike on every rank, whose read began here or was under way already)."""
        if not to_fetch:
            return []  # most steps fetch nothing
        read, path = self.residency.read_fetch, self.residency.source_path
        if self._group is not None:
            names = []
            for name, serial in to_fetch:
                job = LoadJob(name, serial)
                with self.residency.lock:
                    self._open[job] = None
                # Not started when a read of the same registration still runs here (one agreed failed
                # before it ended): its result serves this fetch.
                self.loader.submit(job, functools.partial(read, name, serial), path(name))
                names.append(name)
            return names
        return [
            name
            for name, serial in to_fetch
            if self.loader.submit(LoadJob(name, serial), functools.partial(read, name, serial), path(name))
        ]

    def start_discovery(self, name: str, folder: Path, root: Path | None) -> bool:
        """Read the adapter in ``folder`` (confined to ``root``), to register it as ``name`` once read;
        False when that read is under way already."""
        with self.residency.lock:
            if name in self._room_waits:
                return False  # read already, waiting for room
            self._folders[name] = (folder, root)
        read = functools.partial(self.residency.read_new, name, str(folder), root)
        return self.loader.submit(LoadJob(name, None), read, str(folder))

    def install(self) -> None:
        """Enter every finished read into the host tier (registering discoveries); record each failure.

        With ``tp``: only the fetches finished on every rank, agreed in one collective (none when no fetch
        is open); must then be called by every rank at the same point.
        """
        if self._group is not None:
            self._install_agreed(self._group)
            return
        if not self._no_room and not self._room_waits and self.loader.idle():
            return  # most steps find nothing to install
        with self.residency.lock:
            for done, _, _ in list(self._room_waits.values()):
                self._install_discovery(done)
            waiting, self._no_room = self._no_room, []
            for done in waiting + self.loader.take():
                if done.job.serial is None:
                    self._install_discovery(done)
                elif not self._install_fetch(done, done.job.serial):
                    self._no_room.append(done)

    def wait_any(self, timeout: float | None = None) -> bool:
        """Block until a read finishes (at once if one has since the last install, or none is in
        flight); False on timeout. What it read enters the host tier at the next :meth:`install`."""
        return self.loader.wait_any(timeout)

    def wait(self, names: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until no read of ``names`` (None: of any adapter) is running or queued; False on timeout.
        Completions then wait for :meth:`install`."""
        return self.loader.wait(names, timeout)

    def busy(self, name: str) -> bool:
        """Whether a read of ``name`` is running, queued, or done and not installed yet."""
        with self.residency.lock:
            if any(done.job.name == name for done in self._no_room):
                return True
        return self.loader.busy(name)

    def failed_names(self) -> list[str]:
        """The adapters whose failure waits to be handed to requests (see :meth:`take_errors`): those
        still about the adapter's current registration, or for a discovery a name not registered; a
        failure about an earlier registration is dropped here."""
        if not self._errors:
            return []
        registry = self.residency.registry
        with self.residency.lock:
            for name, (serial, _) in list(self._errors.items()):
                registered = name in registry
                if (serial is None) == registered or (registered and registry.serial(name) != serial):
                    del self._errors[name]
            return list(self._errors)

    def stop_waiting_for_room(self, names: Iterable[str]) -> dict[str, CapacityError]:
        """Drop the discoveries of ``names`` read but waiting for host room (for a caller that cannot
        wait: a batch); returns why each was refused room."""
        with self.residency.lock:
            refused = {}
            for name in names:
                waiting = self._room_waits.pop(name, None)
                if waiting is not None:
                    self._folders.pop(name, None)
                    refused[name] = waiting[2]
            return refused

    def discovering(self) -> list[str]:
        """The ``adapter_dir`` adapters being read before they are registered (not installed yet)."""
        if not self._folders:
            return []
        with self.residency.lock:
            return list(self._folders)

    def take_errors(self, names: Iterable[str]) -> dict[str, LoraPinError]:
        """Hand over (and forget) the failures recorded for ``names``: those still about the adapter's
        current registration (or, for a discovery, about a name still not registered)."""
        registry = self.residency.registry
        taken: dict[str, LoraPinError] = {}
        with self.residency.lock:
            for name in names:
                entry = self._errors.pop(name, None)
                if entry is None:
                    continue
                serial, error = entry
                registered = name in registry
                if (serial is None and not registered) or (
                    serial is not None and registered and registry.serial(name) == serial
                ):
                    taken[name] = error
        return taken

    def forget(self, name: str) -> None:
        """Drop everything pending or held for ``name`` once the registry has forgotten it (an unload
        finished): its reads (one running is abandoned, its worker replaced), what they read, its recorded
        failure, and its tensors (:meth:`~lora_pin.model.residency.Residency.forget`)."""
        self.loader.cancel(name)
        with self.residency.lock:
            self._errors.pop(name, None)
            self._no_room = [done for done in self._no_room if done.job.name != name]
        self.residency.forget(name)

    def close(self) -> None:
        """Stop the loader's threads once their running reads end; reads not started are dropped."""
        self.loader.close()

    def _install_agreed(self, group: TensorParallelGroup) -> None:
        registry = self.residency.registry
        with self.residency.lock:
            for done in self.loader.take():
                # A read of no open fetch (unloaded, or agreed failed before it ended) is dropped.
                if done.job in self._open:
                    self._ready[done.job] = done
            # A fetch whose registration is gone (unloaded on every rank) needs no agreement.
            for job in list(self._open):
                if job.name not in registry or registry.serial(job.name) != job.serial:
                    self._open.pop(job, None)
                    self._ready.pop(job, None)
            jobs = list(self._open)
            outcomes: list[bool | BaseException] = []
            for job in jobs:
                ready = self._ready.get(job)
                if ready is None:
                    outcomes.append(RUNNING)
                elif ready.adapter is not None and self.residency.is_current(job.name, ready.adapter):
                    outcomes.append(READ)
                elif ready.adapter is not None:
                    # Read before a replacement: refused alike on every rank (the ranks' reads may
                    # have ended on either side of it); a later request reads the new weights.
                    outcomes.append(AdapterLoadError(f"adapter {job.name!r}: replaced while it was read"))
                else:
                    outcomes.append(ready.error or AdapterLoadError(f"adapter {job.name!r}: read cancelled"))
        if not jobs:
            return
        # Outside the lock: the loader's threads take it too, and other ranks may still be reading.
        agreements = group.agree_fetches(outcomes)
        finished = self._finish_agreed(group, jobs, agreements)
        with self.residency.lock:
            for job, agreement in zip(jobs, agreements, strict=True):
                if agreement is None:
                    continue
                self._open.pop(job, None)
                ready = self._ready.pop(job, None)
                assert job.serial is not None
                completed = finished.get(job)
                if isinstance(completed, BaseException):
                    # A DoRA norm is zero or a factor out of range: alike on every rank (their norms are).
                    if self.residency.abandon_fetch(job.name, job.serial):
                        self._fail(job.name, job.serial, completed)
                    continue
                if completed is not None:
                    ready = completed
                if ready is not None and not agreement.failed:
                    if not self._install_fetch(ready, job.serial):
                        # No room on any rank (their registries agree): open again, still read here.
                        self._open[job] = None
                        self._ready[job] = ready
                    continue
                # This rank's own read, if it succeeded, is dropped here; one still running is dropped
                # when it ends.
                mine = None if ready is None or ready.adapter is not None else ready.error
                error = agreement.error(f"background read of adapter {job.name!r}", mine)
                if self.residency.abandon_fetch(job.name, job.serial):
                    self._fail(job.name, job.serial, error)

    def _finish_agreed(
        self, group: TensorParallelGroup, jobs: list[LoadJob], agreements: list[Agreement | None]
    ) -> dict[LoadJob, Completion | BaseException]:
        """Every fetch read on every rank, finished over the ranks
        (:meth:`~lora_pin.parallel.Collective.finish_read`, alike on every rank: the jobs and agreements
        are), or why it cannot be served; outside the lock, as any collective."""
        finished: dict[LoadJob, Completion | BaseException] = {}
        for job, agreement in zip(jobs, agreements, strict=True):
            if agreement is None or agreement.failed:
                continue
            with self.residency.lock:
                ready = self._ready.get(job)
            if ready is None or ready.adapter is None:
                continue
            try:
                finished[job] = Completion(ready.job, group.finish_read(ready.adapter), None)
            except LoraPinError as exc:
                finished[job] = exc
        return finished

    def _install_fetch(self, done: Completion, serial: int) -> bool:
        """Install or fail one finished fetch; False when what it read must wait for host room."""
        name = done.job.name
        if done.adapter is not None:
            try:
                self.residency.install_fetch(name, serial, done.adapter)
            except CapacityError:
                return False
        elif self.residency.abandon_fetch(name, serial) and not done.cancelled:
            # A fetch that was over already (unloaded meanwhile) concerns no request.
            self._fail(name, serial, done.error)
        return True

    def _install_discovery(self, done: Completion) -> None:
        name = done.job.name
        folder, root = self._folders.pop(name)
        waited = self._room_waits.pop(name, None)
        if done.adapter is None:
            if not done.cancelled:
                self._fail(name, None, done.error)
            return
        try:
            self.residency.install_new(LoRARef.new(name, str(folder), False), root, done.adapter)
        except DuplicateAdapterError:
            return  # registered meanwhile by another thread: theirs stands
        except CapacityError as exc:
            # Its requests wait while the host tier is full of protected adapters, as a fetch's would.
            give_up = time.monotonic() + DISCOVERY_ROOM_WAIT_SECONDS if waited is None else waited[1]
            if time.monotonic() < give_up:
                self._folders[name] = (folder, root)
                self._room_waits[name] = (done, give_up, exc)
                return
            self._fail(name, None, exc)
        except LoraPinError as exc:
            self._fail(name, None, exc)

    def _fail(self, name: str, serial: int | None, error: BaseException | None) -> None:
        if not isinstance(error, LoraPinError):
            wrapped = AdapterLoadError(f"adapter {name!r}: reading it in the background failed: {error!r}")
            wrapped.__cause__ = error
            error = wrapped
        self._errors[name] = (serial, error)
        self.failures += 1


def checked_load_timeout(timeout: object) -> float:
    """``timeout`` as the seconds a background read may run.

    Raises:
        SpecError: it is not a finite number above 0.
    """
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise SpecError(f"load_timeout must be a finite number of seconds above 0 (got {timeout!r})")
    return float(timeout)


def loading_mode(loading: str | None, parallel: bool, adapter_dir: bool) -> str:
    """The loading mode a manager runs: ``loading``, or its default, background.

    Raises:
        SpecError: ``loading`` is not a mode; an ``adapter_dir`` asked for with tensor parallelism.
    """
    if loading is not None and loading not in LOADING_MODES:
        raise SpecError(f"loading must be one of {', '.join(LOADING_MODES)} (got {loading!r})")
    if parallel and adapter_dir:
        # A discovered adapter is registered when its read ends, under an id drawn where it was read:
        # the ranks would register it at steps and under ids of their own.
        raise SpecError(
            "adapter_dir is not available with tensor parallelism: ranks would discover adapters apart; "
            "load each adapter with LoRAManager.load on every rank"
        )
    return "background" if loading is None else loading
