"""A manager's background reads: adapter reads from disk on a small thread pool, off every step's path.

A step that needs an adapter which is not in host memory does not read it: it defers the requests
and hands the read to :class:`BackgroundReads`. Reads run on the threads of a
:class:`~lora_pin.model.read_pool.ReadPool`; each finished read (or failure) waits in its completion queue
until the manager's next step installs it, under the residency lock, so the host tier and the registry
change only at a step's start, never under a running step.

With tensor parallelism every rank reads its own shards, and its reads end at times of their own; yet
every rank must install a read at the same step, or their registries (and so their plans) would part.
The fetches begun are the same on every rank, in the same order (the registry's plans and prefetches are
deterministic), so each install first agrees over the ranks on every fetch still open
(:meth:`~lora_pin.parallel.Collective.agree_fetches`): one read on every rank is installed; one
that failed on any rank fails on all (a rank whose own read succeeded drops its bytes); any other stays
open. A rank's finished reads wait for that agreement.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from pathlib import Path

from lora_pin._core import LoRARef
from lora_pin.errors import AdapterLoadError, CapacityError, DuplicateAdapterError, LoraPinError, SpecError
from lora_pin.model.read_pool import Completion, ReadJob, ReadPool
from lora_pin.model.residency import Residency
from lora_pin.parallel import Collective
from lora_pin.parallel.collective import READ, RUNNING, Agreement

__all__ = [
    "DEFAULT_LOAD_TIMEOUT",
    "DISCOVERY_ROOM_WAIT_SECONDS",
    "LOADING_MODES",
    "BackgroundReads",
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


class BackgroundReads:
    """One manager's background reads: starts the reads its steps and prefetches ask for, installs what
    they read into the host tier (:meth:`install`, at a step's start), and keeps each failure for the
    requests waiting on that adapter (:meth:`take_errors`).

    Args:
        residency: the manager's tensors and the registry they follow.
        collective: the manager's :class:`~lora_pin.parallel.Collective`. Where the processes' reads end
            apart (:attr:`~lora_pin.parallel.Collective.reads_end_apart`: over tensor-parallel ranks)
            installs agree over them first (see the module's doc): fetches then begin, and installs and
            unloads run, in the same order on every rank, as every collective does, and discoveries are
            not available. On one process each read is installed as it ends.
        workers: reading threads.
        timeout: seconds a read may run before it is abandoned (its requests fail).

    Thread safety: every method may be called from any thread; installs and error records change under
    ``residency.lock``.
    """

    def __init__(
        self,
        residency: Residency,
        collective: Collective,
        workers: int,
        timeout: float = DEFAULT_LOAD_TIMEOUT,
    ) -> None:
        self.residency = residency
        self.collective = collective
        self.pool = ReadPool(workers, timeout)
        # With tp: the fetches begun and not agreed over yet, in the order they began (alike on every
        # rank), and this rank's finished reads of them, waiting for that agreement.
        self._open: dict[ReadJob, None] = {}
        self._ready: dict[ReadJob, Completion] = {}
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
        (over ranks: every name, alike on every rank, whose read began here or was under way already)."""
        if not to_fetch:
            return []  # most steps fetch nothing
        read, path = self.residency.read_fetch, self.residency.source_path
        if self.collective.reads_end_apart:
            names = []
            for name, serial in to_fetch:
                job = ReadJob(name, serial)
                with self.residency.lock:
                    self._open[job] = None
                # Not started when a read of the same registration still runs here (one agreed failed
                # before it ended): its result serves this fetch.
                self.pool.submit(job, functools.partial(read, name, serial), path(name))
                names.append(name)
            return names
        return [
            name
            for name, serial in to_fetch
            if self.pool.submit(ReadJob(name, serial), functools.partial(read, name, serial), path(name))
        ]

    def start_discovery(self, name: str, folder: Path, root: Path | None) -> bool:
        """Read the adapter in ``folder`` (confined to ``root``), to register it as ``name`` once read;
        False when that read is under way already."""
        with self.residency.lock:
            if name in self._room_waits:
                return False  # read already, waiting for room
            self._folders[name] = (folder, root)
        read = functools.partial(self.residency.read_new, name, str(folder), root)
        return self.pool.submit(ReadJob(name, None), read, str(folder))

    def install(self) -> None:
        """Enter every finished read into the host tier (registering discoveries); record each failure.

        Over ranks: only the fetches finished on every rank, agreed in one collective (none when no fetch
        is open); must then be called by every rank at the same point.
        """
        if self.collective.reads_end_apart:
            self._install_agreed()
            return
        if not self._no_room and not self._room_waits and self.pool.idle():
            return  # most steps find nothing to install
        with self.residency.lock:
            for done, _, _ in list(self._room_waits.values()):
                self._install_discovery(done)
            waiting, self._no_room = self._no_room, []
            for done in waiting + self.pool.take():
                if done.job.serial is None:
                    self._install_discovery(done)
                elif not self._install_fetch(done, done.job.serial):
                    self._no_room.append(done)

    def wait_any(self, timeout: float | None = None) -> bool:
        """Block until a read finishes (at once if one has since the last install, or none is in
        flight); False on timeout. What it read enters the host tier at the next :meth:`install`."""
        return self.pool.wait_any(timeout)

    def wait(self, names: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until no read of ``names`` (None: of any adapter) is running or queued; False on timeout.
        Completions then wait for :meth:`install`."""
        return self.pool.wait(names, timeout)

    def busy(self, name: str) -> bool:
        """Whether a read of ``name`` is running, queued, or done and not installed yet."""
        with self.residency.lock:
            if any(done.job.name == name for done in self._no_room):
                return True
        return self.pool.busy(name)

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
        self.pool.cancel(name)
        with self.residency.lock:
            self._errors.pop(name, None)
            self._no_room = [done for done in self._no_room if done.job.name != name]
        self.residency.forget(name)

    def close(self) -> None:
        """Stop the pool's threads once their running reads end; reads not started are dropped."""
        self.pool.close()

    def _install_agreed(self) -> None:
        registry = self.residency.registry
        with self.residency.lock:
            for done in self.pool.take():
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
        # Outside the lock: the pool's threads take it too, and other ranks may still be reading.
        agreements = self.collective.agree_fetches(outcomes)
        finished = self._finish_agreed(jobs, agreements)
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
        self, jobs: list[ReadJob], agreements: list[Agreement | None]
    ) -> dict[ReadJob, Completion | BaseException]:
        """Every fetch read on every rank, finished over the ranks
        (:meth:`~lora_pin.parallel.Collective.finish_read`, alike on every rank: the jobs and agreements
        are), or why it cannot be served; outside the lock, as any collective."""
        finished: dict[ReadJob, Completion | BaseException] = {}
        for job, agreement in zip(jobs, agreements, strict=True):
            if agreement is None or agreement.failed:
                continue
            with self.residency.lock:
                ready = self._ready.get(job)
            if ready is None or ready.adapter is None:
                continue
            try:
                finished[job] = Completion(ready.job, self.collective.finish_read(ready.adapter), None)
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
