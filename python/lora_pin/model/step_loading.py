"""How a step's plan begins under the manager's loading mode.

Background loading (the default): reads finished since the last step enter the host tier, requests whose
adapter is not in host memory are deferred and their reads begin on the loader's threads, and a batch that
must run whole waits for its reads (with tensor parallelism, finished reads enter only once every rank
agrees they are over: :class:`~lora_pin.model.loader.BackgroundLoads`). Blocking loading: the adapters a
step would read are read first, on the calling thread (with tensor parallelism, every rank reads its shards
and all agree), and then the step begins. Either way a read that fails changes nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_pin._core import LoRARegistry
from lora_pin.errors import AdapterLoadError, AdapterNotFoundError, CapacityError, LoraPinError
from lora_pin.model.adapter_dir import adapter_folders
from lora_pin.model.loader import BackgroundLoads
from lora_pin.model.residency import Residency

if TYPE_CHECKING:
    from lora_pin.parallel import TensorParallel
    from lora_pin.parallel.layers import CollectiveLog

__all__ = ["StepLoading"]

# How often a step reads adapters evicted from host memory before it begins, should other threads evict
# them again meanwhile; then the step reads them itself.
_READ_FIRST_ATTEMPTS = 2
# Rounds for a batch waiting for background reads: one may find the host tier full of adapters being read
# (prefetched), the next full of those reads, fresh, and only the one after starts the batch's own reads.
# Each round waits for reads, so a margin past the four a lone caller needs costs nothing (one more round
# may discover adapter_dir adapters).
_FETCH_FIRST_ATTEMPTS = 9


class StepLoading:
    """The part of :class:`~lora_pin.model.LoRAManager` that begins a step's core transaction under its
    loading mode (``loading``) and keeps disk reads off the step's path or ahead of it."""

    registry: LoRARegistry
    residency: Residency
    loading: str
    adapter_dir: Path | None
    tp: TensorParallel | None
    _loads: BackgroundLoads
    _collectives: CollectiveLog | None
    _prefetch_next: list[str]

    if TYPE_CHECKING:  # the manager's own

        def discover(self, names: Iterable[str | None]) -> list[str]: ...

        def _forget(self, name: str) -> None: ...

    def _fetch(self, names: list[str]) -> list[str]:
        """Begin fetching ``names`` (registered) that are not in host memory; the names whose reads began."""
        if not names:
            return []
        return self._loads.start_fetches(self.registry.prefetch(names).to_fetch)

    def _discover_waiting(self, names: Sequence[str | None]) -> None:
        """Register the ``adapter_dir`` adapters of ``names`` not registered yet, read by the loader; waits.
        All or nothing, as :meth:`discover`.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :func:`adapter_folders`; nothing is read then.
            AdapterLoadError, CapacityError: one of them could not be read or registered; those that were
                are unloaded again.
        """
        found = adapter_folders(
            self.registry,
            self.adapter_dir,
            [n for n in dict.fromkeys(names) if n is not None and n not in self.registry],
        )
        if not found:
            return
        for name, folder in found.items():
            self._loads.start_discovery(name, folder, self.adapter_dir)
        self._loads.wait(found)
        self._loads.install()
        errors: dict[str, LoraPinError] = {**self._loads.take_errors(found)}
        errors.update(self._loads.stop_waiting_for_room(found))
        if errors:
            for name, folder in found.items():
                # Only discoveries of these folders go; one a step on another thread has taken up
                # meanwhile stays, as in discover().
                ours = name in self.registry and self.registry.lora_ref(name).lora_path == str(folder)
                if ours and self.registry.in_flight(name) == 0 and self.registry.try_unload(name):
                    self._forget(name)
            raise next(iter(errors.values()))

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

    def _begin(self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool) -> Any:
        """One core transaction: admission, slots, loads and the acquisition of every admitted request;
        a per-sequence batch must run whole (CapacityError, nothing changed, if not).

        Adapters the step would read from disk are read first, outside the transaction, so a read that
        fails changes nothing (in background loading by the loader, waited for); should other threads
        evict them again before the step begins (each time), the step reads them itself.
        """
        discovered = self.adapter_dir is None
        if self.loading == "background":
            wanted = [n for n in dict.fromkeys(names) if n is not None]
            for _ in range(_FETCH_FIRST_ATTEMPTS):
                self._loads.install()
                # Begins no step unless every adapter is in host memory; fetches what is not.
                plan = self.registry.begin_step(
                    names, num_tokens, all_or_nothing=per_sequence, fetch=True, defer_unknown=not discovered
                )
                if plan.unknown:
                    discovered = True
                    self._discover_waiting(plan.unknown)
                    continue
                if plan.ticket is not None:
                    return plan
                self.residency.drop_evicted(n for n, tier, _ in plan.evictions if tier == "host")
                self._loads.start_fetches(plan.to_fetch)
                # With no room for any of its reads, only other reads ending (and installed) make room.
                # With tp each rank waits for its own reads; the install's agreement then waits for the
                # slowest rank's, and every round's outcome is agreed, so all ranks run as many rounds.
                self._loads.wait(wanted if plan.to_fetch else None)
                # Installed reads stay protected ("fresh") until a plan takes their requests up or
                # leaves them out: the next round's plan, which defers this whole batch, leaves out
                # those of other requests, so their room can go to this batch's reads.
                self._loads.install()
                for error in self._loads.take_errors(wanted).values():
                    raise error
        else:
            for _ in range(_READ_FIRST_ATTEMPTS + 1):
                self._loads.install()
                plan = self.registry.begin_step(
                    names,
                    num_tokens,
                    all_or_nothing=per_sequence,
                    read_first=True,
                    defer_unknown=not discovered,
                )
                if plan.unknown:
                    discovered = True
                    self.discover(plan.unknown)
                    continue
                if plan.ticket is not None:
                    return plan
                self._read_first(plan.to_read)
        if self.tp is not None:
            # Reading inside the step would be one rank's read alone: one more round that reads nothing,
            # and then, decided alike on every rank as every round above, all ranks raise.
            background = self.loading == "background"
            if background:
                self._loads.install()
            plan = self.registry.begin_step(
                names, num_tokens, all_or_nothing=per_sequence, fetch=background, read_first=not background
            )
            if plan.ticket is not None:
                return plan
            if background:
                self.residency.drop_evicted(n for n, tier, _ in plan.evictions if tier == "host")
                self._loads.start_fetches(plan.to_fetch)
            raise CapacityError(
                "the step's adapters could not all be brought into host memory before it began (each read "
                "evicted another it needs, or other threads evicted them again); with tensor parallelism a "
                "step never reads from disk itself: retry it, with a larger host tier or fewer adapters"
            )
        # A step's own read takes a fetch's place (its reservation included); the fetch's late result is
        # refused when installed.
        return self.registry.begin_step(names, num_tokens, all_or_nothing=per_sequence)

    def _read_first(self, names: list[str]) -> None:
        """Bring ``names`` (registered, not in host memory) into the host tier before a blocking step
        begins, on this thread; reads the loader is running already are waited for instead. With ``tp``
        every rank reads its own shards, and every rank enters them or every rank fails alike.

        Raises:
            AdapterLoadError: one of them cannot be read (on any rank, with ``tp``), or its files changed
                since it was registered.
        """
        if self.tp is not None:
            self._read_first_agreed(names)
            return
        busy = [n for n in names if self._loads.busy(n)]
        if busy:
            self._loads.wait(busy)
            self._loads.install()
        # A step that reads for itself tries again: a failure of an earlier read is not its answer.
        self._loads.take_errors(names)
        for name in names:
            if name not in busy:
                self.residency.read_into_host(name)

    def _read_first_agreed(self, names: list[str]) -> None:
        # The host tier is part of the plan every rank must agree on: nothing enters it unless every
        # rank read its shards.
        from lora_pin.parallel.collective import agreed

        assert self.tp is not None

        def read_all() -> list[Any]:
            return [(n, self.residency.read_for_host(n)) for n in names]

        read, _ = agreed(self.tp, f"reading {names}", read_all, self._collectives)
        for name, adapter in read:
            self.residency.enter_host(name, adapter)

    def _begin_deferring(self, names: Sequence[str | None], num_tokens: Sequence[int] | int) -> Any:
        """The step transaction of background loading: reads finished since the last step enter the host
        tier first; requests whose adapter is not there are deferred, and their reads begin.

        The core sees every request: those whose adapter's last read failed, or that was unloaded while
        they waited, fail (the plan's ``failed``); those whose ``adapter_dir`` adapter is being read
        wait. A name nobody knows is looked for in ``adapter_dir`` first (nothing is planned until
        then), and its read begins.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :func:`adapter_folders` (nothing changed).
        """
        self._loads.install()
        failed = self._loads.failed_names()
        discovering = self._loads.discovering()
        plan = self.registry.begin_step(
            names,
            num_tokens,
            fetch=True,
            failed=failed,
            discovering=discovering,
            defer_unknown=self.adapter_dir is not None,
        )
        if plan.unknown:
            new = adapter_folders(self.registry, self.adapter_dir, plan.unknown)
            for name, folder in new.items():
                self._loads.start_discovery(name, folder, self.adapter_dir)
            plan = self.registry.begin_step(
                names, num_tokens, fetch=True, failed=failed, discovering=[*discovering, *new]
            )
        self._loads.start_fetches(plan.to_fetch)
        return plan

    def _failures(
        self, names: Sequence[str | None], failed: list[tuple[int, str]]
    ) -> dict[int, LoraPinError]:
        """Why each request of the plan's ``failed`` (``(index, why)``) cannot run, by request index."""
        if not failed:
            return {}
        errors = self._loads.take_errors({n for i, why in failed if why == "read_failed" and (n := names[i])})
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
