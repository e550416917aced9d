"""A plain-Python model of the Rust registry's rules (``PythonPlanner``): dicts and OrderedDicts scanned in
policy order, as SGLang and vLLM keep their LoRA caches. The hypothesis stateful test
(``tests/core/test_core_stateful.py``) checks the Rust registry against it, and ``benches/plan_step.py``
times the Rust planner against it, so both sides provably do the same work."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from lora_pin import errors
from lora_pin._core import LoRARef

# The core's rule (rust/core/src/limits.rs OVERDUE_AFTER): an adapter deferred for room by this many
# consecutive plans that name it is admitted first by the next plans, oldest first.
OVERDUE_AFTER = 4


@dataclass
class Entry:
    """One adapter, as the plain-Python planner keeps it."""

    name: str
    lora_id: str
    rank: int
    host_bytes: int
    scaling: float
    pinned: bool
    in_flight: int = 0
    draining: bool = False
    loading: str | None = None
    in_step: bool = False
    in_host: bool = True
    deferred_plans: int = 0
    slot: int | None = None


@dataclass
class Plan:
    """The plain-Python planner's step plan (lists instead of buffers)."""

    admitted: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    request_slots: list[int] = field(default_factory=list)
    token_slots: list[int] = field(default_factory=list)
    token_perm: list[int] = field(default_factory=list)
    seg_indptr: list[int] = field(default_factory=list)
    seg_slots: list[int] = field(default_factory=list)
    loads: list[tuple[str, str, int, str]] = field(default_factory=list)
    evictions: list[tuple[str, str, int]] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)


def _counters() -> dict[str, int]:
    return {"hits": 0, "misses": 0, "loads": 0, "evictions": 0, "refusals": 0}


class PythonPlanner:
    """The registry's rules in plain Python: victims found by scanning OrderedDicts in policy order.

    Same contract as ``lora_pin.LoRARegistry`` (see its docstrings); raises the same exceptions.
    """

    def __init__(
        self,
        slots: int,
        max_loaded: int | None = None,
        *,
        max_host_bytes: int | None = None,
        policy: str = "lru",
        host_policy: str = "lru",
        chunk_size: int | None = None,
    ) -> None:
        self.slots = slots
        self.max_loaded = max_loaded
        self.max_host_bytes = max_host_bytes
        self.policy = policy
        self.host_policy = host_policy
        self.chunk_size = chunk_size
        self.entries: dict[str, Entry] = {}
        self.by_id: dict[str, Entry] = {}
        self.unloaded: set[str] = set()
        self.slot_of: list[Entry | None] = [None] * slots
        self.epochs = [0] * slots
        self.recency: OrderedDict[str, None] = OrderedDict()
        self.host_order: OrderedDict[str, None] = OrderedDict()
        self.device_order: OrderedDict[str, None] = OrderedDict()
        self.step: list[Entry] = []
        self.host = _counters()
        self.device = _counters()

    # -- helpers ------------------------------------------------------------------------------------
    def _lookup(self, name: str, draining_too: bool) -> Entry:
        e = self.entries.get(name)
        if e is None or (e.draining and not draining_too):
            raise errors.AdapterNotFoundError(f"no adapter named {name!r} is registered")
        return e

    def _pinned(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.pinned]

    def _host_used(self) -> tuple[int, int]:
        resident = [e for e in self.entries.values() if e.in_host]
        return len(resident), sum(e.host_bytes for e in resident)

    def _host_candidate(self, e: Entry) -> bool:
        return e.in_host and not (e.pinned or e.loading or e.in_step) and e.in_flight == 0

    def _device_candidate(self, e: Entry, idle: bool) -> bool:
        protected = e.pinned or e.loading is not None or e.in_step
        return e.slot is not None and not protected and (e.in_flight == 0) == idle

    def _has_room(self, nbytes: int) -> bool:
        count, used = self._host_used()
        return (self.max_loaded is None or count < self.max_loaded) and (
            self.max_host_bytes is None or used + nbytes <= self.max_host_bytes
        )

    def _room_possible(self, nbytes: int) -> bool:
        candidates = [e for e in self.entries.values() if self._host_candidate(e)]
        count, used = self._host_used()
        count -= len(candidates)
        used -= sum(e.host_bytes for e in candidates)
        return (self.max_loaded is None or count < self.max_loaded) and (
            self.max_host_bytes is None or used + nbytes <= self.max_host_bytes
        )

    def _order(self, policy: str, fifo: OrderedDict[str, None]) -> OrderedDict[str, None]:
        return self.recency if policy == "lru" else fifo

    def _free_slot(self, e: Entry) -> int:
        slot = e.slot
        assert slot is not None
        self.slot_of[slot] = None
        self.epochs[slot] += 1
        e.slot = None
        del self.device_order[e.name]
        return slot

    def _evict_device(self, e: Entry, out: list[tuple[str, str, int]]) -> None:
        slot = self._free_slot(e)
        self.device["evictions"] += 1
        out.append((e.name, "device", slot))

    def _leave_host(self, e: Entry) -> None:
        e.in_host = False
        del self.host_order[e.name]

    def _make_host_room(self, nbytes: int, out: list[tuple[str, str, int]]) -> None:
        while not self._has_room(nbytes):
            order = self._order(self.host_policy, self.host_order)
            victim = next(self.entries[n] for n in order if self._host_candidate(self.entries[n]))
            if victim.slot is not None:
                self._evict_device(victim, out)
            self._leave_host(victim)
            self.host["evictions"] += 1
            out.append((victim.name, "host", -1))

    def _take_slot(self, out: list[tuple[str, str, int]]) -> int:
        free = [s for s, e in enumerate(self.slot_of) if e is None]
        if free:
            return free[0]
        order = self._order(self.policy, self.device_order)
        for idle in (True, False):
            for n in order:
                e = self.entries[n]
                if self._device_candidate(e, idle):
                    self._evict_device(e, out)
                    assert e.slot is None
                    return self.slot_of.index(None)
        raise AssertionError("no device victim although one was promised")

    def _slot_possible(self) -> bool:
        return any(
            e is None or self._device_candidate(e, True) or self._device_candidate(e, False)
            for e in self.slot_of
        )

    def _check_fits_beside_pins(self, name: str, nbytes: int) -> None:
        pinned_bytes = sum(e.host_bytes for e in self._pinned())
        if self.max_host_bytes is not None and pinned_bytes + nbytes > self.max_host_bytes:
            self.host["refusals"] += 1
            raise errors.CapacityError(f"cannot register {name!r}: it never fits beside the pinned ones")

    def _check_pin(self, name: str, nbytes: int) -> None:
        pinned = self._pinned()
        if len(pinned) + 1 > self.slots - 1:
            self.device["refusals"] += 1
            raise errors.CapacityError(f"cannot pin {name!r}: {len(pinned)} pinned of {self.slots} slots")
        if self.max_loaded is not None and len(pinned) + 1 > self.max_loaded:
            self.host["refusals"] += 1
            raise errors.CapacityError(f"cannot pin {name!r}: max_loaded_loras={self.max_loaded}")
        if (
            self.max_host_bytes is not None
            and sum(e.host_bytes for e in pinned) + nbytes > self.max_host_bytes
        ):
            self.host["refusals"] += 1
            raise errors.CapacityError(f"cannot pin {name!r}: max_host_bytes={self.max_host_bytes}")
        others = [e.host_bytes for e in self.entries.values() if not e.pinned and e.name != name]
        if (
            self.max_host_bytes is not None
            and others
            and sum(e.host_bytes for e in pinned) + nbytes + max(others) > self.max_host_bytes
        ):
            self.host["refusals"] += 1
            raise errors.CapacityError(f"cannot pin {name!r}: another adapter would no longer fit")

    # -- the API ------------------------------------------------------------------------------------
    def register(self, ref: LoRARef, *, rank: int, host_bytes: int, scaling: float = 1.0) -> list[str]:
        """Registers an adapter already in host memory; returns the host-tier victims' names."""
        old = self.entries.get(ref.lora_name)
        if old is not None:
            if old.draining:
                raise errors.AdapterInUseError(f"{ref.lora_name!r} is being unloaded")
            raise errors.DuplicateAdapterError(f"{ref.lora_name!r} is registered")
        if ref.lora_id in self.by_id:
            raise errors.DuplicateAdapterError(f"id {ref.lora_id} is registered")
        if ref.pinned:
            self._check_pin(ref.lora_name, host_bytes)
        else:
            self._check_fits_beside_pins(ref.lora_name, host_bytes)
        if not self._room_possible(host_bytes):
            self.host["refusals"] += 1
            raise errors.CapacityError(f"cannot register {ref.lora_name!r}: the host tier is full")
        out: list[tuple[str, str, int]] = []
        self._make_host_room(host_bytes, out)
        e = Entry(ref.lora_name, ref.lora_id, rank, host_bytes, scaling, ref.pinned)
        self.entries[e.name] = e
        self.by_id[e.lora_id] = e
        self.unloaded.discard(e.name)
        self.recency[e.name] = None
        self.host_order[e.name] = None
        self.host["loads"] += 1
        return [name for name, tier, _ in out if tier == "host"]

    def pin(self, name: str) -> None:
        """Pins a registered adapter."""
        e = self._lookup(name, False)
        if not e.pinned:
            self._check_pin(name, e.host_bytes)
            e.pinned = True

    def unpin(self, name: str) -> None:
        """Unpins a registered adapter."""
        self._lookup(name, False).pinned = False

    def acquire(self, names: Sequence[str | None]) -> list[str | None]:
        """Counts a request in flight per name; returns the ids."""
        found = [None if n is None else self._lookup(n, False) for n in names]
        for e in found:
            if e is not None:
                e.in_flight += 1
        return [None if e is None else e.lora_id for e in found]

    def release(self, ids: Sequence[str | None]) -> None:
        """Counts a request less in flight per id."""
        wanted: dict[str, int] = {}
        for i in ids:
            if i is not None:
                if i not in self.by_id:
                    raise errors.AdapterNotFoundError(f"id {i}")
                wanted[i] = wanted.get(i, 0) + 1
        for i, n in wanted.items():
            if self.by_id[i].in_flight < n:
                raise errors.UsageError(f"id {i} released {n} times")
        for i, n in wanted.items():
            self.by_id[i].in_flight -= n

    def try_unload(self, name: str) -> bool:
        """Unregisters `name`; forgets it if no request is in flight."""
        e = self.entries.get(name)
        if e is None:
            if name in self.unloaded:
                return True
            raise errors.AdapterNotFoundError(f"no adapter named {name!r}")
        e.draining = True
        e.pinned = False
        if e.in_flight:
            return False
        if e.slot is not None:
            self._free_slot(e)
        if e.in_host:
            self._leave_host(e)
        if e in self.step:
            self.step.remove(e)
        del self.entries[name], self.by_id[e.lora_id], self.recency[name]
        self.unloaded.add(name)
        return True

    def end_step(self) -> None:
        """Ends the latest plan's protection."""
        for e in self.step:
            e.in_step = False
        self.step = []

    def _pending(self, name: str) -> Entry:
        e = self._lookup(name, True)
        if e.loading is None:
            raise errors.UsageError(f"no load of {name!r} is pending")
        return e

    def load_done(self, name: str) -> None:
        """A planned load finished."""
        self._pending(name).loading = None

    def load_failed(self, name: str) -> None:
        """A planned load failed."""
        e = self._pending(name)
        source, e.loading = e.loading, None
        self._free_slot(e)
        if source == "disk":
            self._leave_host(e)

    def plan(self, names: Sequence[str | None], num_tokens: int | Sequence[int]) -> Plan:
        """Plans and commits one step; one int for `num_tokens` is every request's count."""
        if isinstance(num_tokens, int):
            num_tokens = [num_tokens] * len(names)
        if len(names) != len(num_tokens):
            raise errors.UsageError("names and num_tokens differ in length")
        found = [None if n is None else self._lookup(n, True) for n in names]
        self.end_step()
        budget = self.slots - len(self._pinned())
        decided: dict[str, bool] = {}
        unpinned = self._admit_overdue(found, budget, decided, {}, fetch=False)
        for e in found:
            if e is None or e.name in decided:
                continue
            decided[e.name] = admit = e.pinned or unpinned < budget
            if admit:
                unpinned += not e.pinned
                e.in_step = True
                self.step.append(e)
            else:
                self.device["refusals"] += 1
        plan = Plan()
        self._place_step(plan, decided)
        self._outputs(found, num_tokens, decided, plan)
        self._count_deferrals(decided)
        return plan

    def _admit_overdue(
        self,
        found: list[Entry | None],
        budget: int,
        decided: dict[str, bool],
        firsts: dict[str, int],
        fetch: bool,
    ) -> int:
        """Admit the overdue adapters among ``found`` first, oldest first (then by first request), up to
        ``budget``; in fetch mode not those outside the host tier. Returns how many."""
        named = {e.name: e for e in found if e is not None}
        overdue = [
            e
            for e in named.values()
            if e.deferred_plans >= OVERDUE_AFTER and not e.pinned and not (fetch and not e.in_host)
        ]
        overdue.sort(key=lambda e: -e.deferred_plans)
        for e in overdue[:budget]:
            decided[e.name] = True
            e.in_step = True
            self.step.append(e)
            firsts[e.name] = 0
        return len(overdue[:budget])

    def _count_deferrals(
        self, decided: dict[str, bool], waiting_for_read: frozenset[str] = frozenset()
    ) -> None:
        """One more plan deferring each adapter ``decided`` refused (but those waiting for a read), none
        since admission for the admitted ones."""
        for name, admitted in decided.items():
            if name in waiting_for_read:
                continue
            e = self.entries[name]
            e.deferred_plans = 0 if admitted else e.deferred_plans + 1

    def _place_step(self, plan: Plan, decided: dict[str, bool]) -> None:
        """Give each admitted adapter a slot, loading it (from disk when it is not in the host tier);
        one the tiers cannot make room for leaves the step, its requests deferred."""
        for e in list(self.step):
            if e.slot is None:
                refused = self._bring_in(e, plan)
                if refused:
                    (self.host if refused == "host" else self.device)["refusals"] += 1
                    decided[e.name] = False
                    e.in_step = False
                    self.step.remove(e)
                    continue
            else:
                self.device["hits"] += 1
            self.recency.move_to_end(e.name)

    def _bring_in(self, e: Entry, plan: Plan) -> str | None:
        source = "host" if e.in_host else "disk"
        if source == "disk" and not self._can_read(e):
            return "host"
        if not self._slot_possible():
            return "device"
        if source == "disk":
            self._read_for_load(e, plan)
        else:
            self.host["hits"] += 1
        slot = self._take_slot(plan.evictions)
        e.loading = source
        e.slot = slot
        self.slot_of[slot] = e
        self.epochs[slot] += 1
        self.device_order[e.name] = None
        self.device["misses"] += 1
        self.device["loads"] += 1
        plan.loads.append((e.name, e.lora_id, slot, source))
        return None

    def _can_read(self, e: Entry) -> bool:
        """Whether the host tier can make room to read ``e`` from disk for a load."""
        return self._room_possible(e.host_bytes)

    def _read_for_load(self, e: Entry, plan: Plan) -> None:
        """``e`` enters the host tier, read from disk for a load (room made by evicting)."""
        self._make_host_room(e.host_bytes, plan.evictions)
        e.in_host = True
        self.host_order[e.name] = None
        self.host["misses"] += 1
        self.host["loads"] += 1

    def _outputs(
        self, found: list[Entry | None], num_tokens: Sequence[int], decided: dict[str, bool], plan: Plan
    ) -> None:
        for i, (e, n) in enumerate(zip(found, num_tokens, strict=True)):
            if e is not None and not decided[e.name]:
                plan.deferred.append(i)
                continue
            slot = -1 if e is None else e.slot
            assert slot is not None
            plan.admitted.append(i)
            plan.request_slots.append(slot)
            plan.token_slots.extend([slot] * n)
        by_slot: dict[int, list[int]] = {}
        for t, s in enumerate(plan.token_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(t)
        chunk = self.chunk_size or len(plan.token_slots) or 1
        plan.seg_indptr.append(0)
        for s in sorted(by_slot):
            tokens = by_slot[s]
            plan.token_perm.extend(tokens)
            for start in range(0, len(tokens), chunk):
                plan.seg_indptr.append(plan.seg_indptr[-1] + len(tokens[start : start + chunk]))
                plan.seg_slots.append(s)

    def slot_ranks(self) -> list[int]:
        """Per slot: its adapter's rank, 0 when empty."""
        return [0 if e is None else e.rank for e in self.slot_of]

    def stats(self) -> dict[str, dict[str, object]]:
        """Counters, resident and pinned names per tier."""
        out: dict[str, dict[str, object]] = {}
        for tier, counters, here in (
            ("host", self.host, lambda e: e.in_host),
            ("device", self.device, lambda e: e.slot is not None),
        ):
            resident = sorted(e.name for e in self.entries.values() if here(e))
            pinned = sorted(e.name for e in self.entries.values() if here(e) and e.pinned)
            out[tier] = {**counters, "resident": resident, "pinned": pinned}
        return out
