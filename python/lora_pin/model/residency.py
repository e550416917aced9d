"""Residency: the tensors behind the registry's two tiers, kept in step with the Rust core's decisions.

The core decides which adapters are in host memory and which device slot each holds; this object
holds the matching tensors: the host tier's adapters (:class:`~lora_pin.weights.HostTier`), the
device pool (:class:`~lora_pin.weights.DevicePool`), which registration filled each slot, and where
each registered adapter is read from again after a host-tier eviction. Every change to them happens
under one lock, so loads, unloads and steps on different threads never see half of one.

Background reads (:mod:`lora_pin.model.reads`) use :meth:`Residency.read_fetch` on a worker thread,
which changes nothing; what they read enters the host tier with :meth:`Residency.install_fetch`.

On CUDA, a slot's copy from host memory waits only for the steps that read that slot before (an event
recorded when each step finishes; for a paged slot, the steps that read any of its pages, under whichever
slot held them), not for all work queued on the compute stream, and a step waits only for the copies
into its own slots: a copy into a slot the previous step did not read runs while that
step's kernels do. (The pool has one copy stream, so a step's copies still run in order: one that waits
for its slot's readers holds back the copies queued after it.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_pin._core import LoRARef, LoRARegistry
from lora_pin.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    CapacityError,
    LoraPinError,
    StalePlanError,
    UsageError,
)
from lora_pin.model.eviction_counts import TopEvictions
from lora_pin.weights import DevicePool, HostTier, PagedDevicePool
from lora_pin.weights.host_adapter import HostAdapter
from lora_pin.weights.tensors import AdapterTensors

__all__ = ["Residency"]


@dataclass(frozen=True)
class _Source:
    """Where a registered adapter is read from again (its folder, or the tensors it was handed over as),
    and what was registered: the whole adapter's host bytes, the registration serial, the content
    digest and the generation (the how-many-th load of the name in this manager)."""

    path: str
    root: Path | None
    host_bytes: int
    serial: int
    digest: str
    generation: int
    tensors: AdapterTensors | None = None


class Residency:
    """The host tier, the device pool and the slot bookkeeping of one manager.

    Args:
        registry: the core whose decisions this object carries out.
        host: the host tier's tensors.
        pool: the device slots' tensors (``registry.max_loras_per_batch`` slots), or a paged pool's
            (``registry.max_lora_memory`` pages; a slot is an adapter's first page).
    """

    def __init__(self, registry: LoRARegistry, host: HostTier, pool: DevicePool | PagedDevicePool) -> None:
        self.registry = registry
        self.host = host
        self.pool = pool
        self.evictions = TopEvictions()
        # Guards the host tier's dict, the pool's writes and the bookkeeping below against other threads.
        self.lock = threading.RLock()
        self._sources: dict[str, _Source] = {}
        # Per slot: (registry slot epoch, pool write count) right after a step filled it.
        self._filled: list[tuple[int, int] | None] = [None] * pool.slots
        # The last check that passed: the slots it covered with their epochs (``StepPlan.slots_used``'s
        # bytes), the pool's write counts then, and its result. Every change of `_filled` writes its slot
        # (and so changes the counts), so the same slots and counts pass again.
        self._passed: tuple[bytes, tuple[int, ...], tuple[tuple[int, int], ...]] | None = None
        # Reads from disk after start-up and their total seconds (lora_pin.metrics' load-time summary).
        self.reads = 0
        self.read_seconds = 0.0
        # Background reads installed into the host tier (fetches and discoveries).
        self.background_loads = 0
        # The last generation given to each name ever loaded: a name loaded again, after an unload or as
        # a replacement, gets a greater one.
        self._generations: dict[str, int] = {}
        # Per slot: the (name, generation) whose weights a fill put there; a replaced adapter's slot is
        # refreshed by the next step that uses it.
        self._versions: list[tuple[str, int] | None] = [None] * pool.slots
        # Slots refreshed after a replacement.
        self.refreshes = 0
        # Set by a replacement: some slot may hold replaced weights, refreshed before a step reads it.
        self._replaced = False
        cuda = pool.device.type == "cuda"
        # Carries each slot copy's dependencies (the slot's earlier readers) to the pool's copy stream,
        # instead of the compute stream with everything queued on it.
        self._fill_stream = torch.cuda.Stream(pool.device) if cuda else None
        # Per slot (a paged pool: per page): recorded on the compute stream after the last work that read
        # or cleared it.
        self._released: list[torch.cuda.Event | None] = [None] * pool.slots
        # A paged pool: the page_indptr of the last plan its slots were matched against.
        self._matched_indptr: bytes | None = None

    def add(
        self,
        ref: LoRARef,
        root: Path | None = None,
        adapter: HostAdapter | None = None,
        tensors: AdapterTensors | None = None,
    ) -> None:
        """Read the adapter ``ref`` names (unless ``adapter`` holds it read already) and register it,
        holding its weights in the host tier. ``tensors``: it was handed over in memory (and is read
        again from them after a host-tier eviction).

        The read runs outside the lock (it can take long); registering, holding the weights and
        dropping the host tier's victims happen at once under it, so two threads loading one name
        cannot drop each other's copy.

        Raises:
            AdapterLoadError (and subclasses): the adapter cannot be read or served.
            DuplicateAdapterError, AdapterInUseError, CapacityError: as ``LoRARegistry.register``;
                nothing changes then.
        """
        if adapter is None:
            adapter = self._timed_read(ref.lora_name, ref.lora_path, root, tensors)
        with self.lock:
            # The whole adapter's bytes: alike on every tensor-parallel rank, whose registries must agree.
            evicted = self.registry.register(
                ref,
                rank=adapter.max_rank,
                host_bytes=adapter.whole_nbytes,
                device_bytes=self.pool.device_nbytes(adapter.max_rank),
            )
            # Weights still held under the name belong to a registration an unload has just forgotten
            # (its forget has not run yet): stale, replaced.
            self._drop_host(ref.lora_name)
            self.host.add(adapter)
            self.drop_evicted(evicted)
            serial = self.registry.serial(ref.lora_name)
            self._sources[ref.lora_name] = _Source(
                ref.lora_path,
                root,
                adapter.whole_nbytes,
                serial,
                adapter.digest,
                self._next_generation(ref.lora_name),
                tensors,
            )

    def replace(
        self, name: str, adapter: HostAdapter, path: str, root: Path | None, tensors: AdapterTensors | None
    ) -> None:
        """Serve ``adapter`` (read already, from ``path`` or ``tensors``) as the registered ``name`` from
        now on, in place of its weights: the registration (id, pin, requests) stays; the generation grows
        and the digest is ``adapter``'s.

        The new weights enter the host tier at once, whatever tier the old ones were in (a fetch of the
        old ones is over: its read is dropped when it ends). A device slot holding the old weights keeps
        them for the step that runs now, if any, and is refreshed before the next step that uses it.

        Raises:
            AdapterNotFoundError: ``name`` is not registered (or is being unloaded).
            CapacityError: the host tier cannot make room for the new weights, or they would leave a
                registered adapter no room beside the pinned ones (the core decides before any tensor
                is swapped). Nothing changes then.
        """
        with self.lock:
            source = self._sources.get(name)
            if source is None or name not in self.registry:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered: nothing to replace")
            evicted = self.registry.replace(
                name,
                source.serial,
                rank=adapter.max_rank,
                host_bytes=adapter.whole_nbytes,
                device_bytes=self.pool.device_nbytes(adapter.max_rank),
            )
            self._drop_host(name)
            self.host.add(adapter)
            self.drop_evicted(evicted)
            self._sources[name] = _Source(
                path,
                root,
                adapter.whole_nbytes,
                source.serial,
                adapter.digest,
                self._next_generation(name),
                tensors,
            )
            self._replaced = True

    def identity(self, name: str) -> tuple[str, str, int]:
        """``(id, digest, generation)`` of ``name`` (registered, or being unloaded), read at once.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.
        """
        with self.lock:
            source = self._sources.get(name)
            if source is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            return self.registry.lora_ref(name).lora_id, source.digest, source.generation

    def versions(self) -> dict[str, tuple[str, int]]:
        """``(digest, generation)`` of every adapter registered (or being unloaded), by name; call it
        under :attr:`lock` to read it together with the registry."""
        with self.lock:
            return {name: (s.digest, s.generation) for name, s in self._sources.items()}

    def _next_generation(self, name: str) -> int:
        generation = self._generations.get(name, 0) + 1
        self._generations[name] = generation
        return generation

    def read_for_host(self, name: str) -> tuple[HostAdapter, int] | None:
        """Read ``name`` (registered, evicted from host memory) again and check it, changing nothing;
        returns it with the registration serial it was read for (None when it was forgotten meanwhile),
        for :meth:`enter_host`. Tensor-parallel ranks agree on every rank's read before any of them
        enters it.

        Raises:
            AdapterLoadError (and subclasses): the adapter cannot be read, or its files changed since it
                was registered.
        """
        source = self._sources.get(name)
        return None if source is None else (self._read_checked(name, source), source.serial)

    def enter_host(self, name: str, read: tuple[HostAdapter, int] | None) -> None:
        """Enter what :meth:`read_for_host` read into the host tier: only now does the tier make room, so
        a read that failed left every other adapter where it was. An adapter the host tier cannot take
        now (its adapters are all protected), or that was unloaded or registered again meanwhile, is
        skipped: the step defers it, or reads it itself."""
        if read is None:
            return
        adapter, serial = read
        with self.lock:
            try:
                evicted = self.registry.enter_host_tier(name, serial)
            except (AdapterNotFoundError, CapacityError):
                return
            self._drop_host(name)
            self.host.add(adapter)
            self.drop_evicted(evicted)

    def read_fetch(self, name: str, serial: int) -> HostAdapter:
        """Read ``name`` for its fetch under registration ``serial`` (on a loader thread): the same checked
        read as a step's; changes nothing.

        Raises:
            AdapterNotFoundError: ``name`` was forgotten or registered again since the fetch began.
            AdapterLoadError (and subclasses): the adapter cannot be read, or its files changed since it
                was registered.
        """
        while True:
            with self.lock:
                source = self._sources.get(name)
            if source is None or source.serial != serial:
                raise AdapterNotFoundError(f"adapter {name!r}: registration {serial} was unloaded meanwhile")
            adapter = self._read_checked(name, source)
            with self.lock:
                if self._sources.get(name) is source:
                    return adapter
            # Replaced while it was read: the fetch is for what is served now.

    def read_new(
        self, name: str, path: str, root: Path | None, tensors: AdapterTensors | None = None
    ) -> HostAdapter:
        """Read the adapter at ``path`` (or handed over as ``tensors``) as ``name``, confined to ``root``;
        changes nothing but the read counters.

        Raises:
            AdapterLoadError (and subclasses): the adapter cannot be read or served.
        """
        return self._timed_read(name, path, root, tensors)

    def is_current(self, name: str, adapter: HostAdapter) -> bool:
        """Whether ``adapter`` (read for a fetch) holds the weights ``name`` is served with now: False
        once the adapter was replaced (or unloaded) since the read began."""
        with self.lock:
            source = self._sources.get(name)
            return source is not None and source.digest == adapter.digest

    def install_fetch(self, name: str, serial: int, adapter: HostAdapter) -> bool:
        """Enter ``adapter``, read for the fetch of ``name`` under ``serial``, into the host tier, the core
        evicting unprotected adapters for it now that its read has succeeded; False, and nothing held,
        when that fetch is over (the adapter was unloaded, or registered again).

        Raises:
            CapacityError: the adapters protected now (pinned, in a step, fresh) leave it no room; the
                fetch goes on and nothing changed: install it again after a step.
        """
        with self.lock:
            if not self.is_current(name, adapter):
                # Read before a replacement: the next step that needs it fetches the new weights.
                self.abandon_fetch(name, serial)
                return False
            try:
                evicted = self.registry.fetch_done(name, serial)
            except (AdapterNotFoundError, UsageError):
                return False
            self.drop_evicted(evicted)
            self._drop_host(name)
            self.host.add(adapter)
            self.background_loads += 1
            return True

    def source_path(self, name: str) -> str | None:
        """Where registered ``name`` is read from again (None once it is forgotten)."""
        with self.lock:
            source = self._sources.get(name)
        return None if source is None else source.path

    def install_new(self, ref: LoRARef, root: Path | None, adapter: HostAdapter) -> None:
        """Register ``ref`` with ``adapter``, read in the background (a discovery), as :meth:`add`.

        Raises:
            DuplicateAdapterError, AdapterInUseError, CapacityError: as :meth:`add`; nothing changes then.
        """
        with self.lock:
            self.add(ref, root, adapter)
            self.background_loads += 1

    def abandon_fetch(self, name: str, serial: int) -> bool:
        """End the failed fetch of ``name`` under ``serial``: its reservation is released, nothing counted;
        False when that fetch was over already."""
        with self.lock:
            try:
                self.registry.fetch_failed(name, serial)
            except (AdapterNotFoundError, UsageError):
                return False
            return True

    def drop_evicted(self, names: Iterable[str]) -> None:
        """Free the host tensors of ``names``, which the core has just evicted from the host tier."""
        with self.lock:
            for name in names:
                self.evictions[(name, "host")] += 1
                self._drop_host(name)

    def forget(self, name: str) -> None:
        """Free what is held for ``name`` once the registry has forgotten it (an unload finished)."""
        with self.lock:
            if name in self.registry:
                return  # registered again since the unload: what is held is the new adapter's
            self._drop_host(name)
            self._sources.pop(name, None)
            for slot in range(self.pool.slots):
                if self.pool.occupant(slot) == name:
                    self._clear(slot)

    def apply(self, plan: Any, pages: tuple[bytes, bytes] | None = None) -> tuple[tuple[int, int], ...]:
        """Carry out the evictions and loads of step transaction ``plan`` (from ``begin_step``),
        reporting each load to the registry; return ``(slot, pool writes)`` of every slot the step
        uses, after checking each holds what the plan's slot epoch says.

        ``pages``: a paged pool's ``(plan.page_indptr, plan.page_table)``: each load goes into its
        adapter's pages, and a slot the pool still holds whose pages the core freed is released (its
        entries read as rank 0, as the page tables say).

        On any failure the step's remaining loads are left unreported (``finish_step`` fails them)
        and the failed load's slot is emptied, so no later step reads a half-written slot.

        Raises:
            AdapterLoadError: an adapter evicted from host memory could not be read again, or was
                changed on disk since it was registered (its size differs).
            StalePlanError: a slot the step uses does not hold what the plan says; its ``stale_slots``
                lists them, for :meth:`LoRARegistry.invalidate_slots` once the step is finished.
            KeyboardInterrupt, SystemExit: as raised, with the same cleanup.
        """
        loads = plan.loads
        ticket = plan.ticket if loads else None
        with self.lock:
            for name, tier, _slot in plan.evictions:
                self.evictions[(name, tier)] += 1
                if tier == "host":
                    self._drop_host(name)
            epochs = memoryview(plan.slot_epochs).cast("q") if loads else None
            tables = None
            if pages is not None:
                tables = (memoryview(pages[0]).cast("i"), memoryview(pages[1]).cast("i"))
            for index, (name, _lora_id, slot, source) in enumerate(loads):
                try:
                    if source == "disk" or name not in self.host:
                        self._read_again(name)
                    slot_pages = None
                    if tables is not None:
                        indptr, table = tables
                        slot_pages = tuple(table[indptr[slot] : indptr[slot + 1]])
                    self._fill(slot, self.host[name], slot_pages)
                except BaseException as exc:
                    # The slot may be half written: empty it, so no later step can read the remains.
                    self._clear(slot)
                    self.registry.report_load(ticket, index, False)
                    if isinstance(exc, LoraPinError) or not isinstance(exc, Exception):
                        raise
                    raise AdapterLoadError(
                        f"adapter {name!r}: loading into slot {slot} failed: {exc!r}"
                    ) from exc
                assert epochs is not None
                self._filled[slot] = (epochs[slot], self.pool.writes(slot))
                self.registry.report_load(ticket, index, True)
            if pages is not None and pages[0] != self._matched_indptr:
                self._release_freed(pages[0])
            # Bytes of (slot, epoch) pairs: equal to the last step's means the same check passes.
            used_bytes = plan.slots_used
            passed = self._passed
            if self._replaced:
                self._refresh_replaced(_pairs(used_bytes))
            counts = self.pool.write_counts()
            if passed is not None and passed[0] == used_bytes and passed[1] == counts:
                return passed[2]
            used = _pairs(used_bytes)
            filled = self._filled
            stale = {s: g for s, g in used if filled[s] != (g, counts[s])}
            if stale:
                error = StalePlanError(
                    f"the step's plan names slot epoch(s) {stale} but the pool holds "
                    f"{ {s: filled[s] for s in stale} } (epoch, writes) there; no step ran"
                )
                error.stale_slots = list(stale)
                raise error
            writes = tuple([(s, counts[s]) for s, _ in used])
            self._passed = (used_bytes, counts, writes)
            return writes

    def _release_freed(self, indptr_bytes: bytes) -> None:
        """Release every slot the paged pool holds whose pages the core has freed (``page_indptr``: it
        owns none now), so no slot reads as an adapter's but those the page tables give pages."""
        pool = self.pool
        assert isinstance(pool, PagedDevicePool)
        indptr = memoryview(indptr_bytes).cast("i")
        for slot in sorted(pool.live_slots()):
            if indptr[slot + 1] == indptr[slot]:
                self._filled[slot] = None
                self._versions[slot] = None
                self._on_compute(slot, pool.release)
        self._matched_indptr = bytes(indptr_bytes)

    def _refresh_replaced(self, used: Iterable[tuple[int, int]]) -> None:
        """Copy the current weights into each slot of ``used`` (``(slot, generation)`` pairs of the step
        about to run) whose adapter was replaced since the slot was filled; once no slot holds replaced
        weights any more, steps skip this again."""
        for slot, generation in used:
            if self._stale_version(slot):
                try:
                    self._fill(slot, self.host[self.pool.occupant(slot)])
                except BaseException:
                    self._clear(slot)
                    raise
                self._filled[slot] = (generation, self.pool.writes(slot))
                self.refreshes += 1
        self._replaced = any(self._stale_version(s) for s in range(self.pool.slots))

    def _stale_version(self, slot: int) -> bool:
        """Whether ``slot`` holds an adapter's weights from before its replacement."""
        name = self.pool.occupant(slot)
        source = None if name is None else self._sources.get(name)
        return source is not None and self._versions[slot] != (name, source.generation)

    def changed_slots(self, slot_writes: tuple[tuple[int, int], ...]) -> list[int]:
        """The slots among ``slot_writes`` (from :meth:`apply`) written since; on CUDA, also marks the
        end of the step that read them (the current stream's work so far), which their next copy waits for.
        """
        with self.lock:
            counts = self.pool.write_counts()
            if self._fill_stream is not None and slot_writes:
                released = torch.cuda.Event()
                released.record(torch.cuda.current_stream(self.pool.device))
                for slot, _ in slot_writes:
                    for page in self._memory_of(slot):
                        self._released[page] = released
            passed = self._passed
        if passed is not None and passed[1] == counts:
            return []  # no slot written since the last step's check passed (counts only grow)
        return [slot for slot, writes in slot_writes if counts[slot] != writes]

    @property
    def host_bytes(self) -> int:
        """Host bytes the host tier holds."""
        with self.lock:
            return self.host.nbytes

    def _read_again(self, name: str) -> None:
        """Read ``name`` back into the host tier after an eviction, as it was registered."""
        adapter = self._read_checked(name, self._sources[name])
        self._drop_host(name)
        self.host.add(adapter)

    def _read_checked(self, name: str, source: _Source) -> HostAdapter:
        """Read ``name`` from its source, refused unless it is what was registered (the same digest and
        whole bytes; on a tensor-parallel rank, the digest of the whole adapter)."""
        adapter = self._timed_read(name, source.path, source.root, source.tensors)
        if adapter.digest != source.digest or adapter.whole_nbytes != source.host_bytes:
            raise AdapterLoadError(
                f"adapter {name!r} changed {'on disk' if source.tensors is None else 'in memory'} since it "
                f"was registered ({source.path}): it now has digest "
                f"{adapter.digest} and {adapter.whole_nbytes} host bytes, registered with "
                f"{source.digest} and {source.host_bytes}; load it again (replace=True) to serve the new "
                "weights"
            )
        return adapter

    def _timed_read(
        self, name: str, path: str, root: Path | None, tensors: AdapterTensors | None
    ) -> HostAdapter:
        start = time.perf_counter()
        if tensors is None:
            adapter = self.host.read(name, path, root=root)
        else:
            adapter = self.host.read_tensors(tensors)
        with self.lock:
            self.reads += 1
            self.read_seconds += time.perf_counter() - start
        return adapter

    def _fill(self, slot: int, adapter: HostAdapter, pages: tuple[int, ...] | None = None) -> None:
        """Copy ``adapter`` into ``slot`` (a paged pool: into ``pages``, None for the slot's own); on CUDA
        the current stream waits for that copy only, and the copy waits only for the slot's earlier
        readers."""
        source = self._sources.get(adapter.name)
        self._versions[slot] = None if source is None else (adapter.name, source.generation)
        pool = self.pool
        if self._fill_stream is None:
            if isinstance(pool, PagedDevicePool):
                pool.fill(slot, adapter, pages)
            else:
                pool.fill(slot, adapter)
            return
        compute = torch.cuda.current_stream(self.pool.device)
        # A paged slot's pages may have been other (evicted) slots' pages, read by earlier steps.
        memory = {slot} if pages is None else {slot, *pages}
        waits = {id(e): e for p in memory if (e := self._released[p]) is not None}
        with torch.cuda.stream(self._fill_stream):
            for released in waits.values():
                self._fill_stream.wait_event(released)
            # The pool orders its copy after the "current" stream, here the fill stream.
            done = (
                pool.fill(slot, adapter, pages)
                if isinstance(pool, PagedDevicePool)
                else pool.fill(slot, adapter)
            )
        if done is not None:
            compute.wait_event(done)

    def _clear(self, slot: int) -> None:
        """Empty ``slot`` on the current stream, after any copy into it, and record that for the next one."""
        self._filled[slot] = None
        self._versions[slot] = None
        self._on_compute(slot, self.pool.clear)

    def _on_compute(self, slot: int, write: Callable[[int], None]) -> None:
        """Run ``write(slot)`` (a clear or release) on the current stream, after any copy into it, and record
        that for the next one."""
        if self._fill_stream is None:
            write(slot)
            return
        compute = torch.cuda.current_stream(self.pool.device)
        memory = self._memory_of(slot)
        # A copy into the slot that is still queued must not land after the zeros.
        compute.wait_stream(self._fill_stream)
        write(slot)
        released = torch.cuda.Event()
        released.record(compute)
        for page in memory:
            self._released[page] = released

    def _memory_of(self, slot: int) -> tuple[int, ...]:
        """The pool entries ``slot``'s weights live in: the slot, and a paged slot's pages."""
        pool = self.pool
        return (slot, *pool.pages_of(slot)) if isinstance(pool, PagedDevicePool) else (slot,)

    def _drop_host(self, name: str) -> None:
        if name in self.host:
            self.host.drop(name)


def _pairs(used: bytes) -> list[tuple[int, int]]:
    """``StepPlan.slots_used``'s ``(slot, generation)`` pairs."""
    values = memoryview(used).cast("q")
    return list(zip(values[::2], values[1::2], strict=True))
