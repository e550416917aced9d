"""How a step begins under the manager's loading mode: one strategy object per mode.

:class:`BackgroundLoading` (the default): reads finished since the last step enter the host tier,
requests whose adapter is not in host memory are deferred and their reads begin on the read pool's threads,
and a batch that must run whole waits for its reads. :class:`BlockingLoading`: the adapters a step would
read are read first, on the calling thread, and then the step begins. Either way a read that fails changes
nothing else, and with tensor parallelism every read is agreed over the ranks (the manager's
:class:`~lora_pin.parallel.Collective`).

Both share :class:`Discovery`, the one place that finds ``adapter_dir`` folders, reads the adapters found
there, and unloads them again when a call that read them fails.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from lora_pin._core import LoRARef, LoRARegistry, _checked_names
from lora_pin.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    CapacityError,
    DuplicateAdapterError,
    LoraPinError,
    UsageError,
)
from lora_pin.model.adapter_dir import adapter_folders
from lora_pin.model.reads import BackgroundReads
from lora_pin.model.residency import Residency
from lora_pin.parallel import Collective

__all__ = ["BackgroundLoading", "BlockingLoading", "Discovery", "Loading"]

# How a step brings in adapters outside the host tier (``LoRARegistry.begin_step``'s ``mode``).
StepMode = Literal["read_in_step", "read_first", "fetch"]
# The core's reasons for a deferred request whose adapter is not in host memory (Step.loading).
_NOT_IN_HOST = frozenset({"loading", "host_room"})


class Discovery:
    """The ``adapter_dir`` adapters of one manager: where each is, reading them, and undoing a failed call.

    Args:
        residency, loads: the manager's tensors (with the core they follow) and background loads.
        adapter_dir: the manager's ``adapter_dir`` (None: names not registered are not found).
    """

    def __init__(self, residency: Residency, loads: BackgroundReads, adapter_dir: Path | None) -> None:
        self.residency = residency
        self.loads = loads
        self.adapter_dir = adapter_dir

    @property
    def registry(self) -> LoRARegistry:
        """The core the manager's tensors follow."""
        return self.residency.registry

    def folders(self, names: Iterable[str | None]) -> dict[str, Path]:
        """The folder of each name of ``names`` not registered (None entries skipped; each distinct name
        once, in first-appearance order: a step repeats a few names many times).

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :func:`~lora_pin.model.adapter_dir.adapter_folders`.
        """
        registry = self.registry
        return adapter_folders(
            registry,
            self.adapter_dir,
            [n for n in dict.fromkeys(names) if n is not None and n not in registry],
        )

    def read_now(self, names: Sequence[str | None]) -> list[str]:
        """Read and register, on this thread, the adapters of ``names`` not registered yet (all or nothing);
        returns the names registered, in order (see :meth:`~lora_pin.model.LoRAManager.discover`).

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`folders`; nothing is read then.
            AdapterLoadError, CapacityError: one could not be read or registered; those this call
                registered are unloaded again.
        """
        found = self.folders(names)
        loaded: dict[str, Path] = {}
        try:
            for name, folder in found.items():
                try:
                    self.residency.add(LoRARef.new(name, str(folder), False), root=self.adapter_dir)
                except DuplicateAdapterError:
                    continue  # registered meanwhile by another thread: theirs stands
                loaded[name] = folder
        except BaseException:
            self.roll_back(loaded)
            raise
        return list(loaded)

    def start(self, found: Mapping[str, Path]) -> list[str]:
        """Begin reading each of ``found`` (from :meth:`folders`) on the read pool; the names whose reads
        began."""
        return [
            name
            for name, folder in found.items()
            if self.loads.start_discovery(name, folder, self.adapter_dir)
        ]

    def read_waiting(self, names: Sequence[str | None]) -> None:
        """Register the adapters of ``names`` not registered yet, read on the read pool; waits. All or
        nothing, as :meth:`read_now`.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`folders`; nothing is read then.
            AdapterLoadError, CapacityError: one of them could not be read or registered; those that were
                are unloaded again.
        """
        found = self.folders(names)
        if not found:
            return
        self.start(found)
        self.loads.wait(found)
        self.loads.install()
        errors: dict[str, LoraPinError] = {**self.loads.take_errors(found)}
        errors.update(self.loads.stop_waiting_for_room(found))
        if errors:
            self.roll_back(found)
            raise next(iter(errors.values()))

    def roll_back(self, found: Mapping[str, Path]) -> None:
        """Unload again each adapter of ``found`` registered from its folder, unless a step on another
        thread has taken it up meanwhile: then it stays (it loaded fine), rather than be torn down under
        that step. The host tier may still have evicted idle adapters to make room; they are read again
        on demand."""
        registry = self.registry
        for name, folder in found.items():
            ours = name in registry and registry.lora_ref(name).lora_path == str(folder)
            if ours and registry.in_flight(name) == 0 and registry.try_unload(name):
                self.loads.forget(name)


class Loading(ABC):
    """How a manager begins its steps' core transactions (one subclass per ``loading`` mode).

    One loop (:meth:`transaction`) asks the core to begin the step and does what its answer says next
    (``StepPlan.action``): discover names nobody knows, read adapters first, or wait for a whole batch's
    fetches, until a step has begun. It ends by construction: names are discovered once, and a round that
    reads or waits must bring the step closer (the core's answer shrinks, or says waiting helps); a round
    that does not ends the bringing in first: on one process the step reads what it still lacks itself,
    over tensor-parallel ranks (where a read inside a step would be one rank's alone) every rank raises.

    Args:
        residency, loads: the manager's tensors (with the core they follow) and background loads.
        discovery: the manager's ``adapter_dir`` adapters.
        collective: how reads agree over the processes serving the model.
    """

    #: The mode's name, as ``LoRAManager(loading=...)`` takes it.
    mode: str
    #: How its steps bring in adapters outside the host tier (``LoRARegistry.begin_step``'s ``mode``).
    step_mode: StepMode

    def __init__(
        self, residency: Residency, loads: BackgroundReads, discovery: Discovery, collective: Collective
    ) -> None:
        self.residency = residency
        self.loads = loads
        self.discovery = discovery
        self.collective = collective

    @property
    def registry(self) -> LoRARegistry:
        """The core the manager's tensors follow."""
        return self.residency.registry

    @abstractmethod
    def begin(self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool) -> Any:
        """One core transaction for the step ``names`` / ``num_tokens`` (:meth:`transaction`), and what the
        mode does once it has begun; returns the core's begun plan.

        Raises:
            As :meth:`transaction`.
        """

    def waiting_for_reads(self, deferred: tuple[int, ...], reasons: tuple[str, ...]) -> tuple[int, ...]:
        """The requests of ``deferred`` (with the core's ``reasons``) whose adapter is not in host memory
        (:attr:`~lora_pin.model.Step.loading`): none, but in background loading."""
        return ()

    @abstractmethod
    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """:meth:`~lora_pin.model.LoRAManager.split` under this mode."""

    @abstractmethod
    def prefetch(self, names: Iterable[str | None]) -> list[str]:
        """:meth:`~lora_pin.model.LoRAManager.prefetch` under this mode."""

    def transaction(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int, *, whole: bool
    ) -> Any:
        """One core transaction for the step ``names`` / ``num_tokens``: admission, slots, loads and the
        acquisition of every admitted request. ``whole``: a batch that must run whole
        (:class:`CapacityError`, nothing changed, if it cannot). Returns the core's begun plan.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: a name is not registered nor found in
                ``adapter_dir``; nothing is planned.
            AdapterLoadError: an adapter the step must read could not be read; nothing is planned.
            CapacityError: as ``LoRARegistry.begin_step``; or, over tensor-parallel ranks, the step's
                adapters could not all be brought into host memory before it began.
        """
        registry = self.registry
        mode: StepMode = self.step_mode
        discover = self.discovery.adapter_dir is not None
        discovering: list[str] = []
        to_read: list[str] | None = None
        while True:
            self.loads.install()
            failed, held = self._holds(whole)
            plan = registry.begin_step(
                names,
                num_tokens,
                mode,
                whole=whole,
                failed=failed,
                discovering=[*held, *discovering] if discovering else held,
                discover=discover,
            )
            action = plan.action
            if action == "begun":
                return plan
            if action == "discover":
                discover = False
                discovering = self._discover(plan.unknown, whole)
                continue
            if action == "read_first":
                # Reading again what was read already (evicted meanwhile) brings the step no closer.
                progress = to_read is None or len(plan.to_read) < len(to_read)
                to_read = plan.to_read
                if progress:
                    self._read_first(to_read)
                    continue
            elif self._wait_for_fetches(plan, names):
                continue
            if not self.collective.steps_may_read:
                raise CapacityError(
                    "the step's adapters could not all be brought into host memory before it began (each "
                    "read evicted another it needs, or other threads evicted them again); with tensor "
                    "parallelism a step never reads from disk itself: retry it, with a larger host tier or "
                    "fewer adapters"
                )
            # A step's own read takes a fetch's place, its reservation included; the fetch's late result
            # is refused when installed.
            mode = "read_in_step"

    def failures(self, names: Sequence[str | None], failed: list[tuple[int, str]]) -> dict[int, LoraPinError]:
        """Why each request of a plan's ``failed`` (``(index, why)``) cannot run, by request index: its
        adapter's background read failed, or it was unloaded while the request waited."""
        if not failed:
            return {}
        errors = self.loads.take_errors({n for i, why in failed if why == "read_failed" and (n := names[i])})
        out: dict[int, LoraPinError] = {}
        for i, why in failed:
            name = names[i]
            error = errors.get(name) if name is not None else None
            if error is None and why == "read_failed":
                error = AdapterLoadError(f"adapter {name!r}: its background read failed")
            elif error is None:
                error = AdapterNotFoundError(
                    f"adapter {name!r} was unloaded while its requests waited; they do not run"
                )
            out[i] = error
        return out

    def _holds(self, whole: bool) -> tuple[list[str], list[str]]:
        """The names the core plans by hold: adapters whose last read failed, names being discovered."""
        return [], []

    @abstractmethod
    def _discover(self, unknown: list[str], whole: bool) -> list[str]:
        """Discover ``unknown`` (names nobody knows) in ``adapter_dir``; returns those still being read.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`Discovery.folders`.
            AdapterLoadError, CapacityError: a read this waits for failed.
        """

    def _read_first(self, names: list[str]) -> None:
        """Bring ``names`` (registered, not in host memory; a ``"read_first"`` answer) into the host tier
        before the step begins, on this thread; reads the read pool is running already are waited for
        instead. Every read is checked before any enters the host tier, so one that fails changes nothing;
        over ranks every rank reads its own shards, and every rank enters them or every rank fails alike.

        Raises:
            AdapterLoadError: one of them cannot be read (on any rank), or its files changed since it
                was registered.
        """
        busy = [n for n in names if self.loads.busy(n)]
        if busy:
            self.loads.wait(busy)
            self.loads.install()
        # A step that reads for itself tries again: a failure of an earlier read is not its answer.
        self.loads.take_errors(names)
        residency = self.residency
        reads, _ = self.collective.agreed(
            f"reading {names}", lambda: [(n, residency.read_for_host(n)) for n in names if n not in busy]
        )
        finished = [
            (name, None if read is None else (self.collective.finish_read(read[0]), read[1]))
            for name, read in reads
        ]
        for name, read in finished:
            residency.enter_host(name, read)

    def _wait_for_fetches(self, plan: Any, names: Sequence[str | None]) -> bool:
        """Start the fetches of a whole batch's ``"fetching"`` answer and, when the core says waiting can
        change its answer (``plan.progress``), wait for them; returns that.

        Raises:
            AdapterLoadError: a read of one of the batch's adapters failed.
        """
        self.residency.drop_evicted(n for n, tier, _ in plan.evictions if tier == "host")
        self.loads.start_fetches(plan.to_fetch)
        if not plan.progress:
            return False
        wanted = [n for n in dict.fromkeys(names) if n is not None]
        # With no room for any of its reads, only other reads ending (and installed) make room. With tp
        # each rank waits for its own reads; the install's agreement then waits for the slowest rank's,
        # and every answer is agreed, so all ranks run as many rounds.
        self.loads.wait(wanted if plan.to_fetch else None)
        # Installed reads stay protected ("fresh") until a plan takes their requests up or leaves them
        # out: the next answer, which defers this whole batch, leaves out those of other requests, so
        # their room can go to this batch's reads.
        self.loads.install()
        for error in self.loads.take_errors(wanted).values():
            raise error
        return True


class BlockingLoading(Loading):
    """``loading="blocking"``: a step reads the adapters it needs before it begins, on the calling thread
    (``adapter_dir`` adapters too), and every request waits for that."""

    mode = "blocking"
    step_mode: StepMode = "read_first"

    def begin(self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool) -> Any:
        """See :meth:`Loading.begin`."""
        return self.transaction(names, num_tokens, whole=per_sequence)

    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """Reads the ``adapter_dir`` adapters of ``names`` first (see :meth:`Loading.split`)."""
        if self.discovery.adapter_dir is not None:
            self.discovery.read_now(_checked_names(names))
        return self.registry.split(names)

    def prefetch(self, names: Iterable[str | None]) -> list[str]:
        """Refused (see :meth:`Loading.prefetch`).

        Raises:
            UsageError: always.
        """
        raise UsageError("prefetch needs loading='background' (this manager loads blocking)")

    def _discover(self, unknown: list[str], whole: bool) -> list[str]:
        """Reads them now, on this thread (see :meth:`Discovery.read_now`)."""
        self.discovery.read_now(unknown)
        return []


class BackgroundLoading(Loading):
    """``loading="background"``: a step never reads from disk. Requests whose adapter is not in host memory
    are deferred while the read pool reads it; a batch that must run whole waits for its reads. The groups
    after the first of the last :meth:`split` are prefetched by the next step, once it protects its own
    adapters."""

    mode = "background"
    step_mode: StepMode = "fetch"

    def __init__(
        self, residency: Residency, loads: BackgroundReads, discovery: Discovery, collective: Collective
    ) -> None:
        super().__init__(residency, loads, discovery, collective)
        # Adapters of the groups after the first of the last split, prefetched by the next step.
        self._prefetch_next: list[str] = []

    def begin(self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool) -> Any:
        """See :meth:`Loading.begin`: a per-sequence batch waits for its reads; a step defers the requests
        whose adapter is not in host memory and starts their reads, then prefetches the later groups of the
        last :meth:`split`."""
        plan = self.transaction(names, num_tokens, whole=per_sequence)
        self.loads.start_fetches(plan.to_fetch)
        if self._prefetch_next:
            self._prefetch_split()
        return plan

    def waiting_for_reads(self, deferred: tuple[int, ...], reasons: tuple[str, ...]) -> tuple[int, ...]:
        """See :meth:`Loading.waiting_for_reads`: those being read, or waiting for host memory to be read
        into."""
        return tuple(i for i, why in zip(deferred, reasons, strict=True) if why in _NOT_IN_HOST)

    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """Reads the ``adapter_dir`` adapters of ``names`` on the read pool, waiting, and keeps the later
        groups' adapters for the next step to prefetch (see :meth:`Loading.split`)."""
        names = _checked_names(names)
        self.discovery.read_waiting(names)
        groups = self.registry.split(names)
        with self.residency.lock:
            self._prefetch_next = [n for group in groups[1:] for i in group if (n := names[i]) is not None]
        return groups

    def prefetch(self, names: Iterable[str | None]) -> list[str]:
        """Start the reads of ``names`` not in host memory (see :meth:`Loading.prefetch`)."""
        names = _checked_names(names)
        distinct = [n for n in dict.fromkeys(names) if n is not None]
        new = self.discovery.folders(distinct)
        started = self._fetch([n for n in distinct if n not in new])
        started += self.discovery.start(new)
        order = {n: i for i, n in enumerate(distinct)}
        return sorted(set(started), key=order.__getitem__)

    def _fetch(self, names: list[str]) -> list[str]:
        """Begin fetching ``names`` (registered) that are not in host memory; the names whose reads began."""
        if not names:
            return []
        return self.loads.start_fetches(self.registry.prefetch(names).to_fetch)

    def _prefetch_split(self) -> None:
        """Prefetch the later groups of the last :meth:`split`, now that a step protects its adapters."""
        with self.residency.lock:
            names, self._prefetch_next = self._prefetch_next, []
        if names:
            # A hint: an adapter unloaded since the split fails its requests at their own step, not here.
            with contextlib.suppress(LoraPinError):
                self._fetch(list(dict.fromkeys(names)))

    def _holds(self, whole: bool) -> tuple[list[str], list[str]]:
        """A step (not a whole batch, which fails as a whole) lets the requests of adapters whose read
        failed fail, and those of adapters being discovered wait."""
        if whole:
            return [], []
        return self.loads.failed_names(), self.loads.discovering()

    def _discover(self, unknown: list[str], whole: bool) -> list[str]:
        """A whole batch waits for the read pool to read them (:meth:`Discovery.read_waiting`); a step's
        requests wait for them while the read pool reads them."""
        if whole:
            self.discovery.read_waiting(unknown)
            return []
        new = self.discovery.folders(unknown)
        self.discovery.start(new)
        return list(new)
