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
from lora_pin.errors import CapacityError, LoraPinError, UsageError
from lora_pin.model.adapter_dir import adapter_folders
from lora_pin.model.loader import BackgroundLoads
from lora_pin.model.residency import Residency
from lora_pin.model.step import HeldBack

if TYPE_CHECKING:
    from lora_pin.parallel import TensorParallel
    from lora_pin.parallel.layers import CollectiveLog

__all__ = ["StepLoading"]

# How often a step reads adapters evicted from host memory before it begins, should other threads evict
# them again meanwhile; then the step reads them itself.
_READ_FIRST_ATTEMPTS = 2
# Rounds for a batch waiting for background reads: one may find the host tier full of adapters being read
# (prefetched), the next full of those reads, fresh, and only the one after starts the batch's own reads.
# Each round waits for reads, so a margin past the four a lone caller needs costs nothing.
_FETCH_FIRST_ATTEMPTS = 8


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

    def _folders(self, names: list[str]) -> dict[str, Path]:
        """The ``adapter_dir`` folder of each of ``names`` (none registered): :func:`adapter_folders`."""
        return adapter_folders(self.registry, self.adapter_dir, names)

    def _fetch(self, names: list[str]) -> list[str]:
        """Begin fetching ``names`` (registered) that are not in host memory; the names whose reads began."""
        if not names:
            return []
        return self._loads.start_fetches(self.registry.prefetch(names).to_fetch)

    def _discover_waiting(self, names: Sequence[str | None]) -> None:
        """Register the ``adapter_dir`` adapters of ``names`` not registered yet, read by the loader; waits.
        All or nothing, as :meth:`discover`.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`_folders`; nothing is read then.
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
        errors = self._loads.take_errors(found)
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
        if self.loading == "background":
            if self.adapter_dir is not None:
                self._discover_waiting(names)
            wanted = [n for n in dict.fromkeys(names) if n is not None]
            for _ in range(_FETCH_FIRST_ATTEMPTS):
                self._loads.install()
                # Begins no step unless every adapter is in host memory; fetches what is not.
                plan = self.registry.begin_step(names, num_tokens, all_or_nothing=per_sequence, fetch=True)
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
            if self.adapter_dir is not None:
                self.discover(names)
            for _ in range(_READ_FIRST_ATTEMPTS):
                self._loads.install()
                plan = self.registry.begin_step(
                    names, num_tokens, all_or_nothing=per_sequence, read_first=True
                )
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

    def _begin_deferring(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int
    ) -> tuple[Any, HeldBack | None]:
        """The step transaction of background loading: reads finished since the last step enter the host
        tier first; requests whose adapter is not there are deferred, and their reads begin.

        Requests the core never sees: those whose adapter's last read failed (failed now), and those whose
        ``adapter_dir`` adapter is not registered yet (deferred; its read begins).
        """
        self._loads.install()
        held = None
        if self.adapter_dir is not None or self._loads.has_errors:
            held = self._hold_back(names, num_tokens)
        if held is None:
            plan = self.registry.begin_step(names, num_tokens, fetch=True)
        else:
            tokens = num_tokens if isinstance(num_tokens, int) else [num_tokens[i] for i in held.kept]
            plan = self.registry.begin_step([names[i] for i in held.kept], tokens, fetch=True)
            for name, folder in held.new.items():
                self._loads.start_discovery(name, folder, self.adapter_dir)
        self._loads.start_fetches(plan.to_fetch)
        return plan, held

    def _hold_back(self, names: Sequence[str | None], num_tokens: Sequence[int] | int) -> HeldBack | None:
        """Which requests of ``names`` fail or wait without the core; None when every request goes to it.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`_folders` (nothing changed).
            UsageError: ``num_tokens`` is a sequence of another length than ``names``.
        """
        if not isinstance(num_tokens, int) and len(num_tokens) != len(names):
            raise UsageError(f"num_tokens has {len(num_tokens)} entries but names has {len(names)}")
        distinct = [n for n in dict.fromkeys(names) if n is not None]
        new = adapter_folders(
            self.registry, self.adapter_dir, [n for n in distinct if n not in self.registry]
        )
        errors = self._loads.take_errors(distinct)
        if not errors and not new:
            return None
        held = HeldBack(new={n: f for n, f in new.items() if n not in errors})
        for i, name in enumerate(names):
            if name is None or (name not in errors and name not in new):
                held.kept.append(i)
            elif name in errors:
                held.failed[i] = errors[name]
            else:
                held.waiting.append(i)
        return held
