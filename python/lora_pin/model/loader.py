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
(:func:`~lora_pin.parallel.collective.agree_fetches`): one read on every rank is installed; one that
failed on any rank fails on all (a rank whose own read succeeded drops its bytes); any other stays
open. A rank's finished reads wait for that agreement.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lora_pin._core import LoRARef
from lora_pin.errors import AdapterLoadError, CapacityError, DuplicateAdapterError, LoraPinError, SpecError
from lora_pin.model.residency import Residency
from lora_pin.weights.host import HostAdapter

if TYPE_CHECKING:
    from lora_pin.parallel import TensorParallel
    from lora_pin.parallel.layers import CollectiveLog

__all__ = ["LOADING_MODES", "BackgroundLoader", "BackgroundLoads", "Completion", "LoadJob", "loading_mode"]

#: How a manager reads adapters evicted from host memory (see :class:`~lora_pin.model.LoRAManager`).
LOADING_MODES = ("background", "blocking")

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


class BackgroundLoader:
    """Runs adapter reads on ``workers`` threads and queues their completions, in the order they finish.

    Args:
        workers: threads reading at once (at least 1).

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lora_pin-load")
        # Guards the two collections below; waiters are woken on every completion.
        self._changed = threading.Condition()
        self._running: dict[LoadJob, Future[HostAdapter]] = {}
        self._done: list[Completion] = []

    def submit(self, job: LoadJob, read: Callable[[], HostAdapter]) -> bool:
        """Start ``read`` for ``job`` on a worker, unless the same job is in flight or its completion
        waits to be taken; returns whether it started.

        Raises:
            RuntimeError: the loader was closed.
        """
        with self._changed:
            if job in self._running or any(c.job == job for c in self._done):
                return False
            future = self._pool.submit(read)
            self._running[job] = future
        future.add_done_callback(lambda f: self._finished(job, f))
        return True

    def busy(self, name: str) -> bool:
        """Whether a read of ``name`` is running, queued, or done and not yet taken."""
        with self._changed:
            return any(j.name == name for j in self._running) or any(c.job.name == name for c in self._done)

    def running(self) -> list[LoadJob]:
        """The jobs submitted and not finished yet, in submission order."""
        with self._changed:
            return list(self._running)

    def take(self) -> list[Completion]:
        """Every completion not taken yet, in the order the reads finished (never blocks)."""
        with self._changed:
            done, self._done = self._done, []
        return done

    def wait(self, names: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until no read of any of ``names`` (None: of any adapter) is running or queued; returns
        False on timeout. Completions stay queued for :meth:`take`.
        """
        wanted = None if names is None else set(names)
        with self._changed:
            return self._changed.wait_for(
                lambda: not any(wanted is None or j.name in wanted for j in self._running), timeout=timeout
            )

    def cancel(self, name: str) -> None:
        """Drop the reads of ``name`` that have not started (they complete as ``cancelled``); one that is
        running finishes, and its completion is refused when installed."""
        with self._changed:
            futures = [f for j, f in self._running.items() if j.name == name]
        for future in futures:
            future.cancel()

    def close(self) -> None:
        """Cancel every read not started and stop the threads once the running ones end."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _finished(self, job: LoadJob, future: Future[HostAdapter]) -> None:
        if future.cancelled():
            completion = Completion(job, None, None, cancelled=True)
        elif (error := future.exception()) is not None:
            completion = Completion(job, None, error)
        else:
            completion = Completion(job, future.result(), None)
        with self._changed:
            self._running.pop(job, None)
            self._done.append(completion)
            self._changed.notify_all()


class BackgroundLoads:
    """One manager's background loading: starts the reads its steps and prefetches ask for, installs what
    they read into the host tier (:meth:`install`, at a step's start), and keeps each failure for the
    requests waiting on that adapter (:meth:`take_errors`).

    Args:
        residency: the manager's tensors and the registry they follow.
        workers: loader threads.
        tp: this rank's place in a tensor-parallel group: installs agree over its ranks first (see the
            module's doc); fetches then begin, and installs and unloads run, in the same order on every
            rank, as every collective does. Discoveries are not available then.
        log: where the agreements are counted.

    Thread safety: every method may be called from any thread; installs and error records change under
    ``residency.lock``.
    """

    def __init__(
        self,
        residency: Residency,
        workers: int,
        tp: TensorParallel | None = None,
        log: CollectiveLog | None = None,
    ) -> None:
        self.residency = residency
        self.loader = BackgroundLoader(workers)
        self.tp = tp
        self._log = log
        # With tp: the fetches begun and not agreed over yet, in the order they began (alike on every
        # rank), and this rank's finished reads of them, waiting for that agreement.
        self._open: dict[LoadJob, None] = {}
        self._ready: dict[LoadJob, Completion] = {}
        # Why the last background read of an adapter failed, with the registration it was for (None: a
        # discovery), until a step hands it to the requests for that adapter.
        self._errors: dict[str, tuple[int | None, LoraPinError]] = {}
        # Folder and confining root of each adapter_dir adapter being read before it is registered.
        self._folders: dict[str, tuple[Path, Path | None]] = {}
        # Discoveries read but refused room by the host tier: each with the monotonic time it gives up,
        # and the refusal.
        self._room_waits: dict[str, tuple[Completion, float, CapacityError]] = {}
        self.failures = 0

    def start_fetches(self, to_fetch: Iterable[tuple[str, int]]) -> list[str]:
        """Read each ``(name, serial)`` the core has begun fetching; returns the names whose reads began
        (with ``tp``: every name, alike on every rank, whose read began here or was under way already)."""
        read = self.residency.read_fetch
        if self.tp is not None:
            names = []
            for name, serial in to_fetch:
                job = LoadJob(name, serial)
                with self.residency.lock:
                    self._open[job] = None
                # Not started when a read of the same registration still runs here (one agreed failed
                # before it ended): its result serves this fetch.
                self.loader.submit(job, functools.partial(read, name, serial))
                names.append(name)
            return names
        return [
            name
            for name, serial in to_fetch
            if self.loader.submit(LoadJob(name, serial), functools.partial(read, name, serial))
        ]

    def start_discovery(self, name: str, folder: Path, root: Path | None) -> bool:
        """Read the adapter in ``folder`` (confined to ``root``), to register it as ``name`` once read;
        False when that read is under way already."""
        with self.residency.lock:
            if name in self._room_waits:
                return False  # read already, waiting for room
            self._folders[name] = (folder, root)
        read = functools.partial(self.residency.read_new, name, str(folder), root)
        return self.loader.submit(LoadJob(name, None), read)

    def install(self) -> None:
        """Enter every finished read into the host tier (registering discoveries); record each failure.

        With ``tp``: only the fetches finished on every rank, agreed in one collective (none when no fetch
        is open); must then be called by every rank at the same point.
        """
        if self.tp is not None:
            self._install_agreed()
            return
        with self.residency.lock:
            for done, _, _ in list(self._room_waits.values()):
                self._install_discovery(done)
            for done in self.loader.take():
                if done.job.serial is None:
                    self._install_discovery(done)
                else:
                    self._install_fetch(done, done.job.serial)

    def wait(self, names: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until no read of ``names`` (None: of any adapter) is running or queued; False on timeout.
        Completions then wait for :meth:`install`."""
        return self.loader.wait(names, timeout)

    def busy(self, name: str) -> bool:
        """Whether a read of ``name`` is running, queued, or done and not installed yet."""
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
        """Drop what is pending for ``name`` (unloaded): its reads not started, its recorded failure."""
        self.loader.cancel(name)
        with self.residency.lock:
            self._errors.pop(name, None)

    def close(self) -> None:
        """Stop the loader's threads once their running reads end; reads not started are dropped."""
        self.loader.close()

    def _install_agreed(self) -> None:
        from lora_pin.parallel.collective import READ, RUNNING, agree_fetches

        assert self.tp is not None
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
                elif ready.adapter is not None:
                    outcomes.append(READ)
                else:
                    outcomes.append(ready.error or AdapterLoadError(f"adapter {job.name!r}: read cancelled"))
        if not jobs:
            return
        # Outside the lock: the loader's threads take it too, and other ranks may still be reading.
        agreements = agree_fetches(self.tp, outcomes, self._log)
        with self.residency.lock:
            for job, agreement in zip(jobs, agreements, strict=True):
                if agreement is None:
                    continue
                self._open.pop(job, None)
                ready = self._ready.pop(job, None)
                assert job.serial is not None
                if ready is not None and not agreement.failed:
                    self._install_fetch(ready, job.serial)
                    continue
                # This rank's own read, if it succeeded, is dropped here; one still running is dropped
                # when it ends.
                mine = None if ready is None or ready.adapter is not None else ready.error
                error = agreement.error(f"background read of adapter {job.name!r}", mine)
                if self.residency.abandon_fetch(job.name, job.serial):
                    self._fail(job.name, job.serial, error)

    def _install_fetch(self, done: Completion, serial: int) -> None:
        name = done.job.name
        if done.adapter is not None:
            self.residency.install_fetch(name, serial, done.adapter)
        elif self.residency.abandon_fetch(name, serial) and not done.cancelled:
            # A fetch that was over already (unloaded meanwhile) concerns no request.
            self._fail(name, serial, done.error)

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
