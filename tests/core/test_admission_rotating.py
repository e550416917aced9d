"""Admission with rotation (``_core.admit_rotating``, what ``lora_pin.vllm.Scheduler`` asks each step with
``LORA_PIN_VLLM_ROTATE=1``) against a plain-Python model of the rule, and its errors. The guarantees over
many steps (pins, slots, the wait bound, no churn) are checked by a simulated loop in
``rust/core/src/admission_rotating_tests.rs``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_pin._core import admit_rotating
from lora_pin.errors import UsageError


def model(
    adapters: Sequence[int | None],
    waited: Sequence[int],
    running: Sequence[bool],
    pinned: Sequence[int],
    slots: int,
    age_bound: int,
) -> tuple[list[int], list[int], list[int]]:
    """The rule as docs/vllm.md states it, written out plainly."""
    pins = set(pinned)
    in_slot = {a for a, w, r in zip(adapters, waited, running, strict=True) if r and w == 0 and a is not None}

    def aged(i: int) -> bool:
        return waited[i] >= age_bound

    def klass(i: int) -> int:
        adapter = adapters[i]
        if aged(i):
            return 0
        if adapter in pins:
            return 1
        if adapter is None or adapter in in_slot:
            return 2
        return 3

    order = sorted(range(len(adapters)), key=lambda i: (klass(i), -waited[i] if aged(i) else 0, i))
    offered: list[int] = []
    held: list[int] = []
    suspended: list[int] = []
    given_slot: set[int] = set()
    for i in order:
        adapter = adapters[i]
        if adapter is None or adapter in pins or adapter in given_slot:
            offered.append(i)
        elif len(given_slot) < slots - len(pins):
            given_slot.add(adapter)
            offered.append(i)
        else:
            (suspended if running[i] else held).append(i)
    return offered, held, suspended


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.none() | st.integers(1, 6), st.integers(0, 8), st.booleans()), max_size=24
    ),
    pins=st.integers(0, 2),
    extra=st.integers(1, 4),
    age_bound=st.integers(1, 6),
)
def test_admit_rotating_equals_the_plain_model(
    requests: list[tuple[int | None, int, bool]], pins: int, extra: int, age_bound: int
) -> None:
    adapters = [a for a, _, _ in requests]
    waited = [w for _, w, _ in requests]
    running = [r for _, _, r in requests]
    pinned = list(range(1, pins + 1))
    got = admit_rotating(adapters, waited, running, pinned=pinned, slots=pins + extra, age_bound=age_bound)
    assert got == model(adapters, waited, running, pinned, pins + extra, age_bound)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(adapters=[1, None]), "2 adapters but 1 waited counts and 1 running flags"),
        (dict(running=[]), "1 adapters but 1 waited counts and 0 running flags"),
        (dict(adapters=[-1]), "adapter of request 0 must be at least 0"),
        (dict(waited=[-2]), "waited of request 0 must be at least 0"),
        (dict(pinned=[-3]), "a pinned adapter id must be at least 0"),
        (dict(pinned=[1, 2, 2], slots=2), "2 pinned adapters leave no slot for other adapters"),
        (dict(age_bound=0), "age bound must be at least 1"),
        (dict(slots=-1), "slots must be at least 0"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, object], message: str) -> None:
    call: dict[str, object] = dict(adapters=[1], waited=[0], running=[True], pinned=[], slots=2, age_bound=4)
    call.update(kwargs)
    with pytest.raises(UsageError, match=f"admit_rotating: .*{message}"):
        admit_rotating(**call)  # type: ignore[arg-type]
