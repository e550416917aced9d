"""How a step begins under the manager's loading mode: one strategy object per mode.

:class:`BackgroundLoading` (the default): reads finished since the last step enter the host tier,
requests whose adapter is not in host memory are deferred and their reads begin on the loader's threads,
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
from typing import Any

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

# How often a step reads adapters evicted from host memory before it begins, should other threads evict
# them again meanwhile; then the step reads them itself.
_READ_FIRST_ATTEMPTS = 2
# Rounds for a batch waiting for background reads: one may find the host tier full of adapters being read
# (prefetched), the next full of those reads, fresh, and only the one after starts the batch's own reads.
# Each round waits for reads, so a margin past the four a lone caller needs costs nothing (one more round
# may discover adapter_dir adapters).
_FETCH_FIRST_ATTEMPTS = 9
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
        """Begin reading each of ``found`` (from :meth:`folders`) on the loader; the names whose reads
        began."""
        return [
            name
            for name, folder in found.items()
            if self.loads.start_discovery(name, folder, self.adapter_dir)
        ]

    def read_waiting(self, names: Sequence[str | None]) -> None:
        """Register the adapters of ``names`` not registered yet, read by the loader; waits. All or nothing,
        as :meth:`read_now`.

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

    Args:
        residency, loads: the manager's tensors (with the core they follow) and background loads.
        discovery: the manager's ``adapter_dir`` adapters.
        collective: how reads agree over the processes serving the model.
    """

    #: The mode's name, as ``LoRAManager(loading=...)`` takes it.
    mode: str

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
    def begin(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool
    ) -> tuple[Any, tuple[int, ...]]:
        """One core transaction for the step ``names`` / ``num_tokens``: admission, slots, loads and the
        acquisition of every admitted request. ``per_sequence``: a batch that must run whole
        (:class:`CapacityError`, nothing changed, if it cannot). Returns the core's plan and the deferred
        requests whose adapter is not in host memory (:attr:`~lora_pin.model.Step.loading`).

        Raises:
            AdapterNotFoundError, PathNotAllowedError: a name is not registered nor found in
                ``adapter_dir``; nothing is planned.
            AdapterLoadError: an adapter the step must read could not be read; nothing is planned.
            CapacityError: as ``LoRARegistry.begin_step``; or, over tensor-parallel ranks, the step's
                adapters could not all be brought into host memory before it began.
        """

    @abstractmethod
    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """:meth:`~lora_pin.model.LoRAManager.split` under this mode."""

    @abstractmethod
    def prefetch(self, names: Iterable[str | None]) -> list[str]:
        """:meth:`~lora_pin.model.LoRAManager.prefetch` under this mode."""

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

    def _last_round(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool, fetch: bool
    ) -> Any:
        """The step's transaction once reading first has not brought its adapters into host memory: on
        one process the step reads them itself (a step's own read takes a fetch's place, its reservation
        included; the fetch's late result is refused when installed). Over ranks a read inside the step
        would be one rank's alone: one more round that reads nothing, and then, decided alike on every
        rank as every round before, all ranks raise.

        Raises:
            CapacityError: over ranks, that round could not begin the step either.
        """
        if self.collective.steps_may_read:
            return self.registry.begin_step(names, num_tokens, all_or_nothing=per_sequence)
        if fetch:
            self.loads.install()
        plan = self.registry.begin_step(
            names, num_tokens, all_or_nothing=per_sequence, fetch=fetch, read_first=not fetch
        )
        if plan.ticket is not None:
            return plan
        if fetch:
            self.residency.drop_evicted(n for n, tier, _ in plan.evictions if tier == "host")
            self.loads.start_fetches(plan.to_fetch)
        raise CapacityError(
            "the step's adapters could not all be brought into host memory before it began (each read "
            "evicted another it needs, or other threads evicted them again); with tensor parallelism a "
            "step never reads from disk itself: retry it, with a larger host tier or fewer adapters"
        )


class BlockingLoading(Loading):
    """``loading="blocking"``: a step reads the adapters it needs before it begins, on the calling thread
    (``adapter_dir`` adapters too), and every request waits for that."""

    mode = "blocking"

    def begin(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool
    ) -> tuple[Any, tuple[int, ...]]:
        """See :meth:`Loading.begin`; should other threads evict the adapters read first again before the
        step begins (each time), the step reads them itself (one process only)."""
        discovered = self.discovery.adapter_dir is None
        for _ in range(_READ_FIRST_ATTEMPTS + 1):
            self.loads.install()
            plan = self.registry.begin_step(
                names, num_tokens, all_or_nothing=per_sequence, read_first=True, defer_unknown=not discovered
            )
            if plan.unknown:
                discovered = True
                self.discovery.read_now(plan.unknown)
                continue
            if plan.ticket is not None:
                return plan, ()
            self._read_first(plan.to_read)
        return self._last_round(names, num_tokens, per_sequence, fetch=False), ()

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

    def _read_first(self, names: list[str]) -> None:
        """Bring ``names`` (registered, not in host memory) into the host tier before the step begins, on
        this thread; reads the loader is running already are waited for instead. Every read is checked
        before any enters the host tier, so one that fails changes nothing; over ranks every rank reads
        its own shards, and every rank enters them or every rank fails alike.

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


class BackgroundLoading(Loading):
    """``loading="background"``: a step never reads from disk. Requests whose adapter is not in host memory
    are deferred while the loader reads it; a batch that must run whole waits for its reads. The groups
    after the first of the last :meth:`split` are prefetched by the next step, once it protects its own
    adapters."""

    mode = "background"

    def __init__(
        self, residency: Residency, loads: BackgroundReads, discovery: Discovery, collective: Collective
    ) -> None:
        super().__init__(residency, loads, discovery, collective)
        # Adapters of the groups after the first of the last split, prefetched by the next step.
        self._prefetch_next: list[str] = []

    def begin(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool
    ) -> tuple[Any, tuple[int, ...]]:
        """See :meth:`Loading.begin`: a per-sequence batch waits for its reads; a step defers the requests
        whose adapter is not in host memory and starts their reads."""
        if per_sequence:
            plan, loading = self._begin_whole(names, num_tokens), ()
        else:
            plan = self._begin_deferring(names, num_tokens)
            deferred = plan.deferred
            loading = ()
            if deferred:
                reasons = plan.reasons
                loading = tuple(i for i, why in zip(deferred, reasons, strict=True) if why in _NOT_IN_HOST)
        self._prefetch_split()
        return plan, loading

    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """Reads the ``adapter_dir`` adapters of ``names`` on the loader, waiting, and keeps the later
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
        if not self._prefetch_next:
            return
        with self.residency.lock:
            names, self._prefetch_next = self._prefetch_next, []
        if names:
            # A hint: an adapter unloaded since the split fails its requests at their own step, not here.
            with contextlib.suppress(LoraPinError):
                self._fetch(list(dict.fromkeys(names)))

    def _begin_whole(self, names: Sequence[str | None], num_tokens: Sequence[int] | int) -> Any:
        """The transaction of a batch that must run whole: begins no step unless every adapter is in host
        memory, fetching what is not and waiting for the reads, round after round."""
        discovered = self.discovery.adapter_dir is None
        wanted = [n for n in dict.fromkeys(names) if n is not None]
        for _ in range(_FETCH_FIRST_ATTEMPTS):
            self.loads.install()
            plan = self.registry.begin_step(
                names, num_tokens, all_or_nothing=True, fetch=True, defer_unknown=not discovered
            )
            if plan.unknown:
                discovered = True
                self.discovery.read_waiting(plan.unknown)
                continue
            if plan.ticket is not None:
                return plan
            self.residency.drop_evicted(n for n, tier, _ in plan.evictions if tier == "host")
            self.loads.start_fetches(plan.to_fetch)
            # With no room for any of its reads, only other reads ending (and installed) make room.
            # With tp each rank waits for its own reads; the install's agreement then waits for the
            # slowest rank's, and every round's outcome is agreed, so all ranks run as many rounds.
            self.loads.wait(wanted if plan.to_fetch else None)
            # Installed reads stay protected ("fresh") until a plan takes their requests up or
            # leaves them out: the next round's plan, which defers this whole batch, leaves out
            # those of other requests, so their room can go to this batch's reads.
            self.loads.install()
            for error in self.loads.take_errors(wanted).values():
                raise error
        return self._last_round(names, num_tokens, True, fetch=True)

    def _begin_deferring(self, names: Sequence[str | None], num_tokens: Sequence[int] | int) -> Any:
        """The step transaction of background loading: reads finished since the last step enter the host
        tier first; requests whose adapter is not there are deferred, and their reads begin.

        The core sees every request: those whose adapter's last read failed, or that was unloaded while
        they waited, fail (the plan's ``failed``); those whose ``adapter_dir`` adapter is being read
        wait. A name nobody knows is looked for in ``adapter_dir`` first (nothing is planned until
        then), and its read begins.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`Discovery.folders` (nothing changed).
        """
        self.loads.install()
        failed = self.loads.failed_names()
        discovering = self.loads.discovering()
        plan = self.registry.begin_step(
            names,
            num_tokens,
            fetch=True,
            failed=failed,
            discovering=discovering,
            defer_unknown=self.discovery.adapter_dir is not None,
        )
        if plan.unknown:
            new = self.discovery.folders(plan.unknown)
            self.discovery.start(new)
            plan = self.registry.begin_step(
                names, num_tokens, fetch=True, failed=failed, discovering=[*discovering, *new]
            )
        self.loads.start_fetches(plan.to_fetch)
        return plan
