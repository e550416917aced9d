"""Hypothesis drives the Rust registry and a plain-Python model of the same rules
(``tests/core/planner_model.py``'s ``PythonPlanner``, dicts and OrderedDicts scanned in policy order, with the
fetching state and replacements added here) with the same random operations; every result, every plan array,
every error class and the per-tier counters must agree, and the registry's own invariant audit must pass
after every step (replacements included)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lora_pin import errors
from lora_pin._core import LoRARef, LoRARegistry
from lora_pin.errors import LoraPinError

_spec = importlib.util.spec_from_file_location(
    "planner_model", Path(__file__).resolve().parent / "planner_model.py"
)
assert _spec is not None and _spec.loader is not None
planner_model = importlib.util.module_from_spec(_spec)
sys.modules["planner_model"] = planner_model
_spec.loader.exec_module(planner_model)
PythonPlanner = planner_model.PythonPlanner


class FetchingPlanner(PythonPlanner):  # type: ignore[misc,valid-type]
    """``PythonPlanner`` plus background reads, written from the registry's docstrings: a fetching
    adapter's host bytes are reserved, evicting nobody (its room is made once it is done, among the
    resident adapters only); fetch mode defers host misses and fetches them in first-request order, at
    most ``slots - pinned`` ready ahead (pinned and overdue adapters aside); a fetch evicts no adapter the
    latest fetch-mode plan named, but an overdue adapter's fetch those named only after it (youngest first,
    younger admitted adapters yielding); other claims evict unnamed candidates first; a fetched adapter is
    fresh (never evicted) until a plan admits it or leaves it out."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.serials: dict[str, int] = {}
        self.registrations = 0
        self.fetching: dict[str, int] = {}
        self.fresh: list[str] = []
        # Adapter -> its first request in the latest fetch-mode plan (the *named* adapters).
        self.named: dict[str, int] = {}

    def _host_used(self) -> tuple[int, int]:
        count, used = super()._host_used()
        reserved = [self.entries[n] for n in self.fetching]
        return count + len(reserved), used + sum(e.host_bytes for e in reserved)

    def _has_room(self, nbytes: int) -> bool:
        count, used = super()._host_used()
        return (self.max_loaded is None or count < self.max_loaded) and (
            self.max_host_bytes is None or used + nbytes <= self.max_host_bytes
        )

    def _resident_room_possible(self, nbytes: int) -> bool:
        count, used = super()._host_used()
        candidates = [e for e in self.entries.values() if self._host_candidate(e)]
        count -= len(candidates)
        used -= sum(e.host_bytes for e in candidates)
        return (self.max_loaded is None or count < self.max_loaded) and (
            self.max_host_bytes is None or used + nbytes <= self.max_host_bytes
        )

    def _host_candidate(self, e: Any) -> bool:
        return bool(super()._host_candidate(e)) and e.name not in self.fresh

    def _fetch_evictable(self, e: Any) -> tuple[list[Any], int | None]:
        """What a fetch of ``e`` may evict (unnamed candidates; when ``e`` is overdue and named, also those
        named after it), and from which first request named ones are evictable."""
        candidates = [c for c in self.entries.values() if self._host_candidate(c)]
        evictable = [c for c in candidates if c.name not in self.named]
        if e.deferred_plans < planner_model.OVERDUE_AFTER or e.name not in self.named:
            return evictable, None
        first = self.named[e.name] + 1
        return evictable + [c for c in candidates if self.named.get(c.name, -1) >= first], first

    def _fits(self, nbytes: int, evictable: list[Any], reservations_held: bool) -> bool:
        count, used = self._host_used() if reservations_held else super()._host_used()
        count -= len(evictable)
        used -= sum(c.host_bytes for c in evictable)
        return (self.max_loaded is None or count < self.max_loaded) and (
            self.max_host_bytes is None or used + nbytes <= self.max_host_bytes
        )

    def _evict_host(self, victim: Any, out: list[tuple[str, str, int]]) -> None:
        if victim.slot is not None:
            self._evict_device(victim, out)
        self._leave_host(victim)
        self.host["evictions"] += 1
        out.append((victim.name, "host", -1))

    def _candidates_in_order(self) -> list[Any]:
        order = self._order(self.host_policy, self.host_order)
        return [self.entries[n] for n in order if self._host_candidate(self.entries[n])]

    def _make_host_room(self, nbytes: int, out: list[tuple[str, str, int]]) -> None:
        while not self._has_room(nbytes):
            candidates = self._candidates_in_order()
            unnamed = [c for c in candidates if c.name not in self.named]
            self._evict_host((unnamed or candidates)[0], out)

    def _make_fetch_room(self, nbytes: int, first: int | None, out: list[tuple[str, str, int]]) -> None:
        while not self._has_room(nbytes):
            candidates = self._candidates_in_order()
            unnamed = [c for c in candidates if c.name not in self.named]
            if unnamed:
                self._evict_host(unnamed[0], out)
                continue
            assert first is not None
            named = [c for c in candidates if self.named[c.name] >= first]
            self._evict_host(max(named, key=lambda c: self.named[c.name]), out)

    def _device_candidate(self, e: Any, idle: bool) -> bool:
        return bool(super()._device_candidate(e, idle)) and e.name not in self.fresh

    def register(self, ref: LoRARef, **kw: Any) -> list[str]:
        gone: list[str] = super().register(ref, **kw)
        self.registrations += 1
        self.serials[ref.lora_name] = self.registrations
        return gone

    def try_unload(self, name: str) -> bool:
        if name in self.entries:
            self.fetching.pop(name, None)
        done: bool = super().try_unload(name)
        if done and name in self.fresh:
            self.fresh.remove(name)
        if done:
            self.named.pop(name, None)
        return done

    def _start_fetch(self, e: Any, to_fetch: list[tuple[str, int]]) -> bool:
        if not self._fits(e.host_bytes, self._fetch_evictable(e)[0], True):
            self.host["refusals"] += 1
            return False
        self.fetching[e.name] = self.serials[e.name]
        self.host["misses"] += 1
        to_fetch.append((e.name, self.serials[e.name]))
        return True

    def _end_fetch(self, e: Any, out: list[Any], fetch: bool) -> None:
        first = self._fetch_evictable(e)[1]
        del self.fetching[e.name]
        if fetch:
            self._make_fetch_room(e.host_bytes, first, out)
        else:
            self._make_host_room(e.host_bytes, out)
        e.in_host = True
        self.host_order[e.name] = None
        self.host["loads"] += 1

    def _can_read(self, e: Any) -> bool:
        # A blocking read of an adapter being fetched takes over the fetch's reservation.
        if e.name in self.fetching:
            return self._resident_room_possible(e.host_bytes)
        return bool(super()._can_read(e))

    def _read_for_load(self, e: Any, plan: Any) -> None:
        if e.name in self.fetching:
            self._end_fetch(e, plan.evictions, fetch=False)
        else:
            super()._read_for_load(e, plan)

    def plan(self, names: Any, num_tokens: Any, fetch: bool = False) -> Any:
        if isinstance(num_tokens, int):
            num_tokens = [num_tokens] * len(names)
        if len(names) != len(num_tokens):
            raise errors.UsageError("names and num_tokens differ in length")
        found = [None if n is None else self._lookup(n, True) for n in names]
        self.named = {}
        if fetch:
            for i, e in enumerate(found):
                if e is not None:
                    self.named.setdefault(e.name, i)
        self.end_step()
        budget = self.slots - len(self._pinned())
        decided: dict[str, bool] = {}
        waiting: list[tuple[Any, int]] = []
        firsts: dict[str, int] = {}
        unpinned = self._admit_overdue(found, budget, decided, firsts, fetch)
        deferred_in_host = 0
        for i, e in enumerate(found):
            if e is None or e.name in decided:
                continue
            if fetch and not e.in_host:
                decided[e.name] = False
                waiting.append((e, i))
                continue
            decided[e.name] = admit = e.pinned or unpinned < budget
            if admit:
                unpinned += not e.pinned
                e.in_step = True
                self.step.append(e)
                firsts[e.name] = i
            else:
                self.device["refusals"] += 1
                deferred_in_host += 1
        plan = planner_model.Plan()
        plan.to_fetch = []
        ready = deferred_in_host + sum(1 for e, _ in waiting if e.name in self.fetching and not e.pinned)
        for e, first in waiting:
            if e.name in self.fetching:
                continue
            overdue = e.deferred_plans >= planner_model.OVERDUE_AFTER
            if not overdue and not e.pinned and ready >= budget:
                continue
            if overdue and not self._fits(e.host_bytes, self._fetch_evictable(e)[0], True):
                ready += self._yield_room(first, e, firsts, decided)
            if self._start_fetch(e, plan.to_fetch):
                ready += not e.pinned
        self._place_step(plan, decided)
        self.fresh = [n for n in self.fresh if decided.get(n) is False]
        self._outputs(found, num_tokens, decided, plan)
        self._count_deferrals(decided, frozenset(e.name for e, _ in waiting if e.name in self.fetching))
        return plan

    def _yield_room(self, first: int, waiting: Any, firsts: dict[str, int], decided: dict[str, bool]) -> int:
        nbytes = waiting.host_bytes
        evictable = self._fetch_evictable(waiting)[0]
        count, used = self._host_used()
        count -= len(evictable)
        used -= sum(e.host_bytes for e in evictable)
        need_count = 0 if self.max_loaded is None else max(0, count + 1 - self.max_loaded)
        need_bytes = 0 if self.max_host_bytes is None else max(0, used + nbytes - self.max_host_bytes)
        picks = []
        for e in reversed(self.step):
            if firsts[e.name] <= first or (need_count == 0 and need_bytes == 0):
                break
            if e.pinned or e.in_flight or e.loading or e.name in self.fresh:
                continue
            picks.append(e)
            need_count = max(0, need_count - 1)
            need_bytes = max(0, need_bytes - e.host_bytes)
        if need_count or need_bytes:
            return 0
        for e in picks:
            self.step.remove(e)
            e.in_step = False
            decided[e.name] = False
        return len(picks)

    def begin_step(self, names: list[str | None], num_tokens: list[int], fetch: bool) -> Any:
        # Requests of an adapter unloaded (or being unloaded) fail: planned as base requests of no
        # tokens, then taken out of the admitted ones.
        failed = []
        for i, n in enumerate(names):
            if n is None:
                continue
            e = self.entries.get(n)
            if (e is None and n in self.unloaded) or (e is not None and e.draining):
                failed.append(i)
            else:
                self._lookup(n, False)
        names = [None if i in failed else n for i, n in enumerate(names)]
        num_tokens = [0 if i in failed else t for i, t in enumerate(num_tokens)]
        plan = self.plan(names, num_tokens, fetch=fetch)
        kept = [at for at, i in enumerate(plan.admitted) if i not in failed]
        plan.request_slots = [plan.request_slots[at] for at in kept]
        plan.admitted = [plan.admitted[at] for at in kept]
        plan.failed = [(i, "unloaded") for i in failed]
        return plan

    def prefetch(self, names: list[str | None]) -> tuple[list[tuple[str, int]], list[str]]:
        entries = [self._lookup(n, False) for n in names if n is not None]
        to_fetch: list[tuple[str, int]] = []
        skipped: list[str] = []
        shielded = []
        seen: set[str] = set()
        for e in entries:
            if e.name in seen or e.name in self.fetching:
                seen.add(e.name)
                continue
            seen.add(e.name)
            if e.in_host:
                if not e.in_step:
                    e.in_step = True
                    shielded.append(e)
                continue
            if not self._start_fetch(e, to_fetch):
                skipped.append(e.name)
        for e in shielded:
            e.in_step = False
        return to_fetch, skipped

    def _fetch(self, name: str, serial: int) -> Any:
        e = self.entries.get(name)
        if e is None or self.serials[name] != serial:
            raise errors.AdapterNotFoundError(f"{name} (registration {serial})")
        if name not in self.fetching:
            raise errors.UsageError(f"{name!r} is not being fetched")
        return e

    def fetch_done(self, name: str, serial: int) -> list[str]:
        e = self._fetch(name, serial)
        if not self._fits(e.host_bytes, self._fetch_evictable(e)[0], False):
            raise errors.CapacityError(f"{name!r} cannot enter the host tier yet")
        out: list[tuple[str, str, int]] = []
        self._end_fetch(e, out, fetch=True)
        self.fresh.append(name)
        return [n for n, tier, _ in out if tier == "host"]

    def replace(self, name: str, serial: int, *, rank: int, host_bytes: int) -> list[str]:
        """New weights of ``host_bytes`` for the registration ``serial`` of ``name``, held in host memory:
        refused when the pinned adapters, with every unpinned one beside them, would not fit in the host
        tier (``pin``'s rule) or no room can be made; else room is made as for a registration and the
        adapter ends in the host tier (a fetch of it is over, and it is fresh)."""
        e = self._lookup(name, False)
        if self.serials[name] != serial:
            raise errors.AdapterNotFoundError(f"{name} (registration {serial})")
        if self.max_host_bytes is not None:
            pinned = sum(p.host_bytes for p in self._pinned() if p is not e) + (host_bytes if e.pinned else 0)
            unpinned = [o.host_bytes for o in self.entries.values() if not o.pinned and o is not e]
            unpinned += [] if e.pinned else [host_bytes]
            if pinned + max(unpinned, default=0) > self.max_host_bytes:
                self.host["refusals"] += 1
                raise errors.CapacityError(
                    f"cannot replace {name!r}: an adapter would not fit beside the pins"
                )
        # Out of the candidates and the ledger while room is made, as if it had left.
        was_host, was_fetching, in_step = e.in_host, name in self.fetching, e.in_step
        e.in_host, e.in_step = False, True
        self.fetching.pop(name, None)
        if not self._room_possible(host_bytes):
            e.in_host, e.in_step = was_host, in_step
            if was_fetching:
                self.fetching[name] = serial
            self.host["refusals"] += 1
            raise errors.CapacityError(f"cannot replace {name!r}: the host tier is full")
        out: list[tuple[str, str, int]] = []
        self._make_host_room(host_bytes, out)
        e.host_bytes, e.rank, e.in_host, e.in_step = host_bytes, rank, True, in_step
        if not was_host:
            self.host_order[name] = None
            self.host["loads"] += 1
        if was_fetching:
            self.fresh.append(name)
        return [n for n, tier, _ in out if tier == "host"]

    def fetch_failed(self, name: str, serial: int) -> None:
        del self.fetching[self._fetch(name, serial).name]

    def stats(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = super().stats()
        out["host"]["fetching"] = sorted(self.fetching)
        out["host"]["reserved_bytes"] = sum(self.entries[n].host_bytes for n in self.fetching)
        return out


NAMES = [f"n{i}" for i in range(7)]
names = st.sampled_from(NAMES)


def ints(buf: bytearray) -> list[int]:
    return torch.frombuffer(buf, dtype=torch.int32).tolist() if buf else []


def same_outcome(rust: Any, model: Any) -> Any:
    """Runs both calls; both must return equal values or raise the same lora_pin error class."""
    try:
        expected = model()
    except LoraPinError as e:
        with pytest.raises(type(e)):
            rust()
        return None
    return expected, rust()


class RegistryVsModel(RuleBasedStateMachine):
    reg: LoRARegistry
    model: Any

    @initialize(
        slots=st.integers(1, 3),
        extra=st.none() | st.integers(0, 3),
        max_bytes=st.none() | st.integers(300, 1200),
        policy=st.sampled_from(["lru", "fifo"]),
        host_policy=st.sampled_from(["lru", "fifo"]),
        chunk=st.none() | st.integers(1, 3),
    )
    def start(
        self,
        slots: int,
        extra: int | None,
        max_bytes: int | None,
        policy: str,
        host_policy: str,
        chunk: int | None,
    ) -> None:
        loaded = None if extra is None else slots + extra
        kw: dict[str, Any] = {"max_host_bytes": max_bytes, "chunk_size": chunk}
        self.reg = LoRARegistry(slots, loaded, eviction_policy=policy, host_eviction_policy=host_policy, **kw)
        self.model = FetchingPlanner(slots, loaded, policy=policy, host_policy=host_policy, **kw)
        # The step held open (its ticket and its requests' ids in the model), and the last one finished.
        self.held: tuple[int, list[str | None]] | None = None
        self.finished = 0
        # Fetches handed out and not reported yet: name -> serial.
        self.fetches: dict[str, int] = {}

    @rule(name=names, pinned=st.booleans(), nbytes=st.integers(1, 400), rank=st.integers(1, 16))
    def register(self, name: str, pinned: bool, nbytes: int, rank: int) -> None:
        ref = LoRARef(name, f"/srv/{name}", pinned=pinned)
        got = same_outcome(
            lambda: self.reg.register(ref, rank=rank, host_bytes=nbytes, device_bytes=nbytes),
            lambda: self.model.register(ref, rank=rank, host_bytes=nbytes),
        )
        if got:
            assert got[0] == got[1]

    @rule(nbytes=st.integers(1, 150))
    def register_every_name(self, nbytes: int) -> None:
        """More adapters than slots, so steps contend for slots and victims must be chosen."""
        for name in NAMES:
            self.register(name, False, nbytes, 8)

    @rule(data=st.data(), rank=st.integers(1, 16), stale=st.sampled_from([0, 0, 0, 1]))
    def replace(self, data: st.DataObject, rank: int, stale: int) -> None:
        """New weights in place for a registered adapter, a pinned one as often as any (any name when
        none is registered; ``stale``: for a registration that is no longer the name's). Their bytes are
        often the edge of the room the pins leave it, on either side."""
        registered = sorted(self.model.entries)
        pinned = sorted(e.name for e in self.model._pinned())
        choices = [st.sampled_from(c) for c in (pinned, registered) if c]
        name = data.draw(st.one_of(choices) if choices else names)
        edges = []
        e = self.model.entries.get(name)
        if e is not None and self.model.max_host_bytes is not None:
            others = [o for o in self.model.entries.values() if o is not e]
            room = self.model.max_host_bytes - sum(o.host_bytes for o in others if o.pinned)
            if e.pinned:
                room -= max((o.host_bytes for o in others if not o.pinned), default=0)
            edges = [b for b in (room, room + 1) if b >= 1]
        nbytes = data.draw(st.integers(1, 600) | st.sampled_from(edges) if edges else st.integers(1, 600))
        serial = self.model.serials.get(name, 0) + stale
        got = same_outcome(
            lambda: self.reg.replace(name, serial, rank=rank, host_bytes=nbytes, device_bytes=nbytes),
            lambda: self.model.replace(name, serial, rank=rank, host_bytes=nbytes),
        )
        if got:
            assert got[0] == got[1]

    @rule(name=names)
    def pin(self, name: str) -> None:
        same_outcome(lambda: self.reg.pin(name), lambda: self.model.pin(name))

    @rule(name=names)
    def unpin(self, name: str) -> None:
        same_outcome(lambda: self.reg.unpin(name), lambda: self.model.unpin(name))

    @precondition(lambda self: self.held is None)
    @rule(requests=st.lists(st.none() | names, min_size=1, max_size=4))
    def hold(self, requests: list[str | None]) -> None:
        """A step begun and held open while other operations run: its admitted requests are in flight
        (an unload of their adapter waits for the finish), its adapters protected as in the step."""
        got = same_outcome(
            lambda: self.reg.begin_step(requests, 1),
            lambda: self.model.begin_step(requests, [1] * len(requests), False),
        )
        if not got:
            return
        expected, plan = got
        assert (plan.admitted, plan.deferred, plan.failed) == (
            expected.admitted,
            expected.deferred,
            expected.failed,
        )
        assert plan.loads == expected.loads and plan.evictions == expected.evictions
        ids = self.model.acquire([requests[i] for i in expected.admitted])
        for i, (name, *_) in enumerate(plan.loads):
            self.reg.report_load(plan.ticket, i, True)  # type: ignore[arg-type]
            self.model.load_done(name)
        self.held = (plan.ticket, ids)

    @precondition(lambda self: self.held is not None)
    @rule()
    def finish_held(self) -> None:
        ticket, ids = self.held
        self.reg.finish_step(ticket)
        self.model.release(ids)
        self.model.end_step()
        self.held = None
        self.finished = ticket

    @rule()
    def finish_again(self) -> None:
        """Finishing a step that is not open is refused and changes nothing (the audit and the model
        comparison after every rule see it)."""
        with pytest.raises(errors.UsageError):
            self.reg.finish_step(self.finished)

    @rule(name=names)
    def unload(self, name: str) -> None:
        got = same_outcome(lambda: self.reg.try_unload(name), lambda: self.model.try_unload(name))
        if got:
            assert got[0] == got[1]

    @precondition(lambda self: self.held is None)
    @rule(
        requests=st.lists(st.tuples(st.none() | names, st.integers(0, 3)), max_size=10),
        fetch=st.booleans(),
        report=st.booleans(),
    )
    def step(self, requests: list[tuple[str | None, int]], fetch: bool, report: bool) -> None:
        """A step transaction, reading in the step what it needs or (``fetch``) deferring host misses and
        fetching them; its loads reported done as a serving loop would, or failed by the finish."""
        batch = [n for n, _ in requests]
        tokens = [t for _, t in requests]
        got = same_outcome(
            lambda: self.reg.begin_step(batch, tokens, "fetch" if fetch else "read_in_step"),
            lambda: self.model.begin_step(batch, tokens, fetch),
        )
        if not got:
            return
        expected, plan = got
        assert plan.failed == expected.failed
        assert plan.admitted == expected.admitted
        assert plan.deferred == expected.deferred
        assert ints(plan.request_slots) == expected.request_slots
        assert ints(plan.token_slots) == expected.token_slots
        assert ints(plan.token_perm) == expected.token_perm
        assert ints(plan.seg_indptr) == expected.seg_indptr
        assert ints(plan.seg_slots) == expected.seg_slots
        assert plan.loads == expected.loads
        assert plan.evictions == expected.evictions
        assert plan.to_fetch == expected.to_fetch
        assert ints(plan.slot_ranks) == self.model.slot_ranks()
        assert torch.frombuffer(plan.slot_epochs, dtype=torch.int64).tolist() == self.model.epochs
        if fetch:
            assert all(src == "host" for *_, src in plan.loads)
        self.fetches.update(plan.to_fetch)
        assert plan.ticket is not None
        for i, (name, *_) in enumerate(plan.loads):
            if report:
                self.reg.report_load(plan.ticket, i, True)
                self.model.load_done(name)
            else:
                self.model.load_failed(name)
        self.reg.finish_step(plan.ticket)
        self.model.end_step()

    @rule(queue=st.lists(st.none() | names, max_size=6))
    def prefetch(self, queue: list[str | None]) -> None:
        got = same_outcome(lambda: self.reg.prefetch(queue), lambda: self.model.prefetch(queue))
        if got:
            (to_fetch, skipped), plan = got
            assert (plan.to_fetch, plan.skipped) == (to_fetch, skipped)
            self.fetches.update(plan.to_fetch)

    @precondition(lambda self: bool(self.fetches))
    @rule(data=st.data(), ok=st.booleans())
    def report_fetch(self, data: st.DataObject, ok: bool) -> None:
        """A background read finishes (or fails); its fetch may have been cancelled since."""
        name = data.draw(st.sampled_from(sorted(self.fetches)))
        serial = self.fetches.pop(name)
        if ok:
            got = same_outcome(
                lambda: self.reg.fetch_done(name, serial), lambda: self.model.fetch_done(name, serial)
            )
            if got:
                assert got[0] == got[1]
            elif name in self.reg.stats()["host"]["fetching"] and self.reg.serial(name) == serial:
                self.fetches[name] = serial  # no room yet: it goes on
        else:
            same_outcome(
                lambda: self.reg.fetch_failed(name, serial), lambda: self.model.fetch_failed(name, serial)
            )

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "reg"):
            return
        self.reg.audit()
        stats = self.reg.stats()
        for tier, expected in self.model.stats().items():
            assert {k: stats[tier][k] for k in expected} == expected, tier


TestRegistryVsModel = RegistryVsModel.TestCase
TestRegistryVsModel.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
