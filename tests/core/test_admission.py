"""Admission for engines that keep their own slots (``_core.admit_waiting``, what ``lora_pin.vllm.Scheduler``
asks each step) against a plain-Python model of the rule, a steady-traffic scenario, and its errors."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_pin._core import admit_waiting
from lora_pin.errors import UsageError


def model(
    adapters: Sequence[int | None],
    waited: Sequence[int],
    running: Sequence[int],
    pinned: Sequence[int],
    slots: int,
    age_bound: int,
) -> tuple[list[int], list[int]]:
    """The rule as docs/vllm.md states it, written out plainly."""
    pins, busy = set(pinned), set(running) - set(pinned)
    free = max(0, slots - len(pins) - len(busy))

    def aged(i: int) -> bool:
        return waited[i] >= age_bound

    def klass(i: int) -> int:
        adapter = adapters[i]
        if aged(i):
            return 0
        if adapter in pins:
            return 1
        if adapter is None or adapter in busy:
            return 2
        return 3

    order = sorted(range(len(adapters)), key=lambda i: (klass(i), -waited[i] if aged(i) else 0, i))
    offered: list[int] = []
    held: list[int] = []
    new: set[int] = set()
    draining = False
    for i in order:
        adapter = adapters[i]
        if adapter is None or adapter in pins or adapter in new:
            offered.append(i)
        elif draining:
            held.append(i)
        elif adapter in busy:
            offered.append(i)
        elif len(new) < free:
            new.add(adapter)
            offered.append(i)
        else:
            held.append(i)
            draining = aged(i)
    return offered, held


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(st.tuples(st.none() | st.integers(1, 6), st.integers(0, 8)), max_size=24),
    running=st.lists(st.integers(1, 6), max_size=5),
    pins=st.integers(0, 2),
    extra=st.integers(1, 4),
    age_bound=st.integers(1, 6),
)
def test_admit_waiting_equals_the_plain_model(
    requests: list[tuple[int | None, int]], running: list[int], pins: int, extra: int, age_bound: int
) -> None:
    adapters = [a for a, _ in requests]
    waited = [w for _, w in requests]
    pinned = list(range(1, pins + 1))
    args = (adapters, waited, running, pinned, pins + extra, age_bound)
    got = admit_waiting(
        adapters, waited, running=running, pinned=pinned, slots=pins + extra, age_bound=age_bound
    )
    assert got == model(*args)


def test_a_steady_adapter_drains_for_an_aged_request() -> None:
    # One slot, adapter 1 running with a new request every step (each runs 3 steps), adapter 2's
    # request waiting since step 1, age bound 1: from step 2 adapter 1's requests wait, aged or not,
    # and adapter 2 gets the slot at step 4, when adapter 1's last run ends.
    runs: dict[int, int] = {}  # request -> the step its run ends at
    arrival = {r: r for r in range(12)}
    adapter = dict.fromkeys(range(12), 1)
    arrival[100], adapter[100] = 1, 2
    offered_at: dict[int, int] = {}
    for step in range(12):
        runs = {r: end for r, end in runs.items() if end > step}
        waiting = sorted(r for r in arrival if arrival[r] <= step and r not in offered_at)
        waiting.sort(key=lambda r: arrival[r])
        offered, _ = admit_waiting(
            [adapter[r] for r in waiting],
            [step - arrival[r] for r in waiting],
            running=[adapter[r] for r in runs],
            pinned=[],
            slots=1,
            age_bound=1,
        )
        for i in offered:
            offered_at[waiting[i]] = step
            runs[waiting[i]] = step + 3
    assert offered_at[100] == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(adapters=[1, None], waited=[0]), "2 adapters but 1 waited counts"),
        (dict(adapters=[-1], waited=[0]), "adapter of request 0 must be at least 0"),
        (dict(adapters=[1], waited=[-2]), "waited of request 0 must be at least 0"),
        (dict(running=[-3]), "a running adapter id must be at least 0"),
        (dict(pinned=[1, 2, 2], slots=2), "2 pinned adapters leave no slot for other adapters"),
        (dict(age_bound=0), "age bound must be at least 1"),
        (dict(slots=-1), "slots must be at least 0"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, object], message: str) -> None:
    call: dict[str, object] = dict(adapters=[1], waited=[0], running=[], pinned=[], slots=2, age_bound=4)
    call.update(kwargs)
    with pytest.raises(UsageError, match=message):
        admit_waiting(**call)  # type: ignore[arg-type]
