"""The registry's fetching state through its Python face: `begin_step(mode="fetch")` defers host
misses and starts their fetches, `prefetch` starts them ahead of a step, `fetch_done` /
`fetch_failed` end them, and an unload cancels one. Background mode is opt-in: in another mode
every call keeps its meaning."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from lora_pin._core import FetchPlan, LoRARef, LoRARegistry
from lora_pin.errors import AdapterNotFoundError, CapacityError, SpecError, UsageError

# Rounds each thread of the threaded test runs at least (a third of a second on an idle machine).
ROUNDS = 20_000
# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120


def make(slots: int = 2, loaded: int | None = 2, names: str = "abc") -> LoRARegistry:
    """`slots` slots, a host tier of `loaded` adapters; registering past it evicts the oldest."""
    reg = LoRARegistry(slots, loaded)
    for i, n in enumerate(names):
        reg.register(LoRARef(n, f"/srv/{n}"), rank=4 + i, host_bytes=100, device_bytes=50, scaling=0.5)
    return reg


def test_a_host_miss_is_deferred_and_fetched_and_admitted_after_fetch_done() -> None:
    reg = make()
    assert reg.stats()["host"]["resident"] == ["b", "c"]
    serial = reg.serial("a")
    plan = reg.begin_step(["a", "b", None, "a"], 1, "fetch")
    assert plan.ticket is not None
    assert plan.admitted == [1, 2] and plan.deferred == [0, 3]
    assert plan.to_fetch == [("a", serial)]
    assert plan.evictions == [], "a reservation evicts nobody"
    assert [src for *_, src in plan.loads] == ["host"]
    host = reg.stats()["host"]
    assert host["fetching"] == ["a"] and host["reserved_bytes"] == 100
    assert host["resident"] == ["b", "c"] and host["bytes"] == 200 and reg.stats()["fetching"] == 1
    reg.audit()
    reg.finish_step(plan.ticket)
    assert reg.fetch_done("a", serial) == ["c"], "the room is made once the read has succeeded"
    reg.audit()
    assert reg.stats()["host"]["resident"] == ["a", "b"] and reg.stats()["fetching"] == 0
    plan = reg.begin_step(["a"], 1, "fetch")
    assert plan.admitted == [0] and plan.to_fetch == []
    assert [src for *_, src in plan.loads] == ["host"]
    assert "to_fetch=0" in repr(plan)


def test_without_fetch_a_host_miss_is_still_read_in_the_step() -> None:
    reg = make()
    plan = reg.begin_step(["a"], 1)
    assert plan.admitted == [0] and plan.to_fetch == []
    assert [src for *_, src in plan.loads] == ["disk"]


def test_fetch_reports_for_a_cancelled_or_stale_fetch_are_refused_and_change_nothing() -> None:
    reg = make()
    serial = reg.serial("a")
    reg.finish_step(reg.begin_step(["a"], 1, "fetch").ticket)  # type: ignore[arg-type]
    before = reg.stats()
    with pytest.raises(AdapterNotFoundError, match="registration"):
        reg.fetch_done("a", serial + 7)
    with pytest.raises(AdapterNotFoundError):
        reg.fetch_failed("zzz", serial)
    assert reg.stats() == before
    reg.fetch_failed("a", serial)
    host = reg.stats()["host"]
    assert host["fetching"] == [] and host["reserved_bytes"] == 0 and "a" not in host["resident"]
    with pytest.raises(UsageError, match="not being fetched"):
        reg.fetch_done("a", serial)
    reg.audit()


def test_unload_cancels_a_fetch_and_its_late_report_is_refused() -> None:
    reg = make()
    serial = reg.serial("a")
    plan = reg.prefetch(["a"])
    assert plan.to_fetch == [("a", serial)]
    reg.unload("a")
    host = reg.stats()["host"]
    assert host["fetching"] == [] and host["reserved_bytes"] == 0
    with pytest.raises(AdapterNotFoundError):
        reg.fetch_done("a", serial)
    reg.audit()


def test_prefetch_takes_a_waiting_queue_and_keeps_its_head_resident() -> None:
    reg = make(names="abcd")  # c and d resident; a and b evicted
    with pytest.raises(AdapterNotFoundError):
        reg.prefetch(["a", "nope"])
    assert reg.stats()["fetching"] == 0
    plan = reg.prefetch([None, "d", "a", "a", None, "b"])
    assert isinstance(plan, FetchPlan)
    assert plan.to_fetch == [("a", reg.serial("a"))]
    assert plan.skipped == ["b"] and reg.stats()["host"]["resident"] == ["c", "d"]
    assert "to_fetch=1" in repr(plan)
    with pytest.raises(TypeError):
        reg.prefetch([3])  # type: ignore[list-item]
    reg.audit()


def test_an_adapter_being_fetched_may_be_pinned_and_stays_once_fetched() -> None:
    reg = make()  # b and c resident
    serial = reg.serial("a")
    assert reg.prefetch(["a"]).to_fetch == [("a", serial)]
    reg.pin("a")
    reg.audit()
    assert reg.stats()["pinned_names"] == ["a"] and reg.stats()["host"]["pinned"] == []
    reg.fetch_done("a", serial)
    assert reg.stats()["host"]["pinned"] == ["a"]
    # Pinned and resident: b (evicted for a) cannot take a's place, nor that of c, which an
    # older request keeps in the step.
    plan = reg.begin_step(["c", "b"], 1, "fetch")
    assert plan.to_fetch == [] and plan.deferred == [1]
    reg.audit()


def test_begin_step_names_each_answer_and_refuses_an_unknown_mode() -> None:
    reg = make()
    with pytest.raises(UsageError, match="mode must be"):
        reg.begin_step(["a"], 1, "fetch_first")  # type: ignore[arg-type]
    plan = reg.begin_step(["a", "x"], 1, "read_first", discover=True)
    assert (plan.action, plan.unknown, plan.ticket) == ("discover", ["x"], None)
    plan = reg.begin_step(["b", "a"], 1, "read_first")
    assert (plan.action, plan.to_read, plan.ticket, plan.admitted) == ("read_first", ["a"], None, [])
    assert "read_first" in repr(plan)
    assert reg.stats()["fetching"] == 0 and reg.in_flight("b") == 0, "no step began"
    plan = reg.begin_step(["b", "a"], 1, "read_in_step")
    assert (plan.action, plan.to_read, plan.unknown) == ("begun", [], [])
    assert [src for *_, src in plan.loads] == ["host", "disk"]
    reg.finish_step(plan.ticket)  # type: ignore[arg-type]
    reg.audit()


def test_all_or_nothing_in_fetch_mode_begins_once_the_batch_is_in_the_host_tier() -> None:
    reg = make()
    plan = reg.begin_step(["b", "a"], 1, "fetch", whole=True)
    assert (plan.action, plan.progress) == ("fetching", True)
    assert plan.ticket is None and plan.deferred == [0, 1] and plan.admitted == []
    assert plan.to_fetch == [("a", reg.serial("a"))]
    # b is in the batch: the room for a comes from c, once a has been read.
    assert plan.evictions == []
    assert reg.fetch_done("a", reg.serial("a")) == ["c"]
    plan = reg.begin_step(["b", "a"], 1, "fetch", whole=True)
    assert plan.ticket is not None and plan.admitted == [0, 1]
    reg.finish_step(plan.ticket)
    with pytest.raises(CapacityError):
        make(slots=1).begin_step(["b", "c"], 1, "fetch", whole=True)


def test_steps_prefetches_and_reports_from_threads_keep_every_invariant() -> None:
    """A serving loop in fetch mode, a loader reporting fetches and a scheduler prefetching, on three
    threads at once: no deadlock, no error but the refused reports (and reads that must wait for host
    room while a step holds it), and the audit passes."""
    names = [f"n{i}" for i in range(12)]
    reg = make(slots=4, loaded=6, names="")
    for n in names:
        reg.register(LoRARef(n, f"/srv/{n}"), rank=8, host_bytes=100, device_bytes=50)
    started: list[tuple[str, int]] = []
    lock = threading.Lock()
    stop = threading.Event()
    failures: list[BaseException] = []

    # Each thread runs at least ROUNDS rounds, all three at once: a count of work, not a span of time, so
    # a busy machine runs the same interleavings, only slower.
    rounds_done = [threading.Event() for _ in range(3)]

    def guarded(body: Callable[[random.Random], None], seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(seed)
            try:
                rounds = 0
                while not stop.is_set():
                    body(rng)
                    rounds += 1
                    if rounds == ROUNDS:
                        rounds_done[seed].set()
            except BaseException as e:  # the main thread reports it
                failures.append(e)
                rounds_done[seed].set()

        return run

    def serve(rng: random.Random) -> None:
        plan = reg.begin_step([rng.choice([*names, None]) for _ in range(8)], 1, "fetch")
        assert plan.ticket is not None
        for i in range(len(plan.loads)):
            reg.report_load(plan.ticket, i, True)
        reg.finish_step(plan.ticket)
        with lock:
            started.extend(plan.to_fetch)

    def load(rng: random.Random) -> None:
        with lock:
            if not started:
                return
            name, serial = started.pop(rng.randrange(len(started)))
        try:
            (reg.fetch_done if rng.random() < 0.9 else reg.fetch_failed)(name, serial)
        except CapacityError:
            # The step on the other thread holds the room: the read stays done, reported again.
            with lock:
                started.append((name, serial))

    def schedule(rng: random.Random) -> None:
        plan = reg.prefetch([rng.choice(names) for _ in range(3)])
        with lock:
            started.extend(plan.to_fetch)

    threads = [threading.Thread(target=guarded(f, i)) for i, f in enumerate((serve, load, schedule))]
    for t in threads:
        t.start()
    for done in rounds_done:
        assert done.wait(HANG_GUARD_S), "deadlock: a thread stopped making rounds"
    stop.set()
    for t in threads:
        t.join(timeout=HANG_GUARD_S)
        assert not t.is_alive(), "deadlock"
    assert not failures, failures
    reg.audit()
    assert reg.stats()["host"]["reserved_bytes"] == 100 * len({n for n, _ in started})


def _pinned_c_and_b_in_a_slot() -> LoRARegistry:
    """Three slots: ``c`` pinned, ``b`` in a slot after a step, ``a`` outside the device tier."""
    reg = make(slots=3, loaded=None)
    reg.pin("c")
    plan = reg.begin_step(["b"], 1)
    for i in range(len(plan.loads)):
        reg.report_load(plan.ticket, i, True)  # type: ignore[arg-type]
    reg.finish_step(plan.ticket)  # type: ignore[arg-type]
    return reg


def test_offer_order_ranks_waiting_requests_by_the_cores_rule() -> None:
    """Running first; then waiting: overdue, pinned, free (base, in a slot), the rest (a name not
    registered among them), each in the given order."""
    from lora_pin._core import OVERDUE_AFTER

    reg = _pinned_c_and_b_in_a_slot()
    names = ["a", None, "a", "c", "a", "b", "gone", None]
    overtaken = [0, 0, None, 0, OVERDUE_AFTER, 1, 0, None]
    assert reg.offer_order(names, overtaken) == [2, 7, 4, 3, 1, 5, 0, 6]
    with pytest.raises(UsageError, match="overtaken"):
        reg.offer_order(["a"], [])


def test_longest_remaining_offers_overdue_then_roomless_then_most_tokens_left() -> None:
    """``order="longest_remaining"``: overdue waiting requests, then those that take no device room
    (base, pinned), then the rest by tokens left, most first, running before waiting on a tie; an
    adapter in a slot is not preferred. Bad arguments are refused by name."""
    from lora_pin._core import OVERDUE_AFTER

    reg = _pinned_c_and_b_in_a_slot()
    names = ["a", None, "a", "c", "a", "b", "gone", "a"]
    overtaken = [0, 0, None, 0, OVERDUE_AFTER, 1, 0, None]
    remaining = [5, 1, 3, 2, 1, 9, 3, None]
    # 4 overdue; 3 and 1 take no room (pinned c: 2 left, base: 1); then 7 (no limit), 5 (b in a slot:
    # 9 left), 0 (5), 2 (running, 3) before 6 (waiting, 3).
    order = reg.offer_order(names, overtaken, remaining, "longest_remaining")
    assert order == [4, 3, 1, 7, 5, 0, 2, 6]
    # The tokens left change nothing in arrival order.
    assert reg.offer_order(names, overtaken, remaining) == reg.offer_order(names, overtaken)
    with pytest.raises(UsageError, match="remaining tokens"):
        reg.offer_order(names, overtaken, None, "longest_remaining")
    with pytest.raises(UsageError, match="remaining counts"):
        reg.offer_order(names, overtaken, [1], "longest_remaining")
    with pytest.raises(SpecError, match='got "shortest"'):
        reg.offer_order(names, overtaken, remaining, "shortest")
