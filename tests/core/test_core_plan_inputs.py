"""How `LoRARegistry.begin_step` reads its arguments: names recognised by identity (a cache that must never
map a name to a stale adapter), `num_tokens` as one int or any sequence, and `admitted` built by
slicing; every result compared with the same step given in the plain form."""

from __future__ import annotations

import random
from typing import Any

import pytest

from lora_pin._core import LoRARef, LoRARegistry, StepPlan
from lora_pin.errors import AdapterNotFoundError, SpecError, UsageError


def make(slots: int = 4, names: str = "abcdef") -> LoRARegistry:
    reg = LoRARegistry(slots)
    for i, n in enumerate(names):
        reg.register(LoRARef(n, f"/srv/{n}"), rank=1 + i, host_bytes=10, device_bytes=10)
    return reg


def outputs(plan: StepPlan) -> tuple[object, ...]:
    return (
        plan.admitted,
        plan.deferred,
        bytes(plan.request_slots),
        bytes(plan.token_slots),
        bytes(plan.token_perm),
        bytes(plan.seg_indptr),
        bytes(plan.seg_slots),
        bytes(plan.slot_ranks),
        plan.loads,
        plan.evictions,
    )


def run(reg: LoRARegistry, names: Any, num_tokens: Any) -> StepPlan:
    """One step transaction over ``names``: begun (reading what it needs in the step), its loads reported
    done, finished; returns its plan."""
    plan = reg.begin_step(names, num_tokens)
    for index in range(len(plan.loads)):
        reg.report_load(plan.ticket, index, True)  # type: ignore[arg-type]
    reg.finish_step(plan.ticket)  # type: ignore[arg-type]
    return plan


def fresh(name: str | None) -> str | None:
    """An equal str that is a different object from any earlier one."""
    return None if name is None else "".join(list(name))


def test_same_objects_fresh_objects_tuples_and_generators_plan_alike() -> None:
    rng = random.Random(1)
    steps = [[rng.choice("abcdef") if rng.random() > 0.2 else None for _ in range(40)] for _ in range(30)]
    regs = [make() for _ in range(4)]
    for step in steps:
        tokens = [rng.randint(0, 3) for _ in step]
        plans = [
            run(regs[0], step, tokens),
            run(regs[1], [fresh(n) for n in step], tokens),
            run(regs[2], tuple(step), tuple(tokens)),
            run(regs[3], (n for n in step), iter(tokens)),
        ]
        first = outputs(plans[0])
        assert all(outputs(p) == first for p in plans[1:]), step


def test_token_counts_from_a_generator_of_fresh_ints_are_each_read() -> None:
    # Each int is freed once read, and the next may be made at the same address: no identity shortcut.
    reg = make()
    counts = [1000 + i for i in range(6)]
    plan = run(reg, ["a"] * 6, (1000 + i for i in range(6)))
    assert plan.num_tokens == sum(counts)
    assert list(memoryview(plan.seg_indptr).cast("i"))[-1] == sum(counts)


def test_bools_are_not_token_counts() -> None:
    reg = make()
    with pytest.raises(UsageError, match="num_tokens must be an int"):
        run(reg, ["a"], True)
    with pytest.raises(UsageError, match=r"num_tokens\[1\] must be an int, got True"):
        run(reg, ["a", "b"], [1, True])


def test_limits_name_their_minimum_and_the_slot_ceiling() -> None:
    with pytest.raises(SpecError, match=r"max_loras_per_batch must be at least 1 \(got -1\)"):
        LoRARegistry(-1)
    with pytest.raises(SpecError, match="at most 65536 device slots"):
        LoRARegistry(2**32 - 1)
    reg = make()
    with pytest.raises(SpecError, match="past 2\\^64 bytes"):
        for i in range(3):
            reg.register(LoRARef(f"big{i}", f"/b/{i}"), rank=1, host_bytes=2**63 - 1, device_bytes=1)
    assert "big2" not in reg
    reg.audit()

    step = ["a", None, "b", "c", "a", "d", "e", None]
    for n in (0, 1, 3):
        assert outputs(run(make(), step, n)) == outputs(run(make(), step, [n] * len(step)))


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -1], r"num_tokens\[1\] must be in 0..=4294967295 \(got -1\)"),
        ([1, 2**40], r"num_tokens\[1\] must be in 0..=4294967295 \(got 1099511627776\)"),
        ([1, 2**70], r"num_tokens\[1\] must be in 0..=4294967295 \(got 1180591620717411303424\)"),
        ([1.0, 1], r"num_tokens\[0\] must be an int, got float"),
        (-2, r"num_tokens must be in 0..=4294967295 \(got -2\)"),
        (2.5, r"num_tokens must be an int or a sequence of ints, got float"),
        ([1], r"plan got 2 adapter names but 1 token counts"),
    ],
)
def test_bad_token_counts_name_the_value(tokens: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        run(make(), ["a", "b"], tokens)  # type: ignore[arg-type]


def test_bad_names_name_the_item() -> None:
    reg = make()
    with pytest.raises(UsageError, match=r"names\[1\] must be an adapter name \(str\) or None, got int"):
        run(reg, ["a", 7], 1)  # type: ignore[list-item]
    with pytest.raises(UsageError, match="names must be a sequence of adapter names"):
        run(reg, 5, 1)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="got the str 'ab'"):
        run(reg, "ab", 1)
    with pytest.raises(AdapterNotFoundError, match='"zz"'):
        run(reg, ["a", "zz"], 1)


def test_a_str_subclass_is_a_name() -> None:
    class Name(str):
        pass

    reg = make()
    plan = run(reg, [Name("a"), Name("a"), "b"], 1)
    assert [load[0] for load in plan.loads] == ["a", "b"]


def test_a_cached_name_object_follows_unload_and_register() -> None:
    reg = make(slots=4, names="ab")
    a = fresh("a")
    assert run(reg, [a], 1).loads[0][0] == "a"
    reg.unload("a")
    # Its key is free now; a new adapter takes it. The cached object must not resolve to it.
    reg.register(LoRARef("c", "/srv/c"), rank=7, host_bytes=10, device_bytes=10)
    # A step's request for it fails alone (unloaded while it waited); a batch that must run whole is refused.
    plan = run(reg, [a], 1)
    assert (plan.failed, plan.loads, plan.admitted) == ([(0, "unloaded")], [], [])
    with pytest.raises(AdapterNotFoundError, match='"a"'):
        reg.begin_step([a], 1, whole=True)
    reg.register(LoRARef("a", "/srv/a2"), rank=9, host_bytes=10, device_bytes=10)
    plan = run(reg, [a, "c"], 1)
    assert [(n, i) for n, i, _, _ in plan.loads] == [
        ("a", LoRARef("a", "/srv/a2").lora_id),
        ("c", LoRARef("c", "/srv/c").lora_id),
    ]
    slots = {name: slot for name, _, slot, _ in plan.loads}
    ranks = memoryview(plan.slot_ranks).cast("i")
    assert ranks[slots["a"]] == 9 and ranks[slots["c"]] == 7


def test_a_polled_unload_never_unloads_a_later_adapter_of_the_same_name() -> None:
    reg = make(names="ab")
    held = reg.begin_step(["a"], 1)  # an open step holds a's request
    handle = reg.begin_unload("a")
    assert handle is not None and reg.finish_unload(handle) == 1
    reg.finish_step(held.ticket)  # type: ignore[arg-type]
    assert reg.try_unload("a") is True  # someone else finishes it by name...
    reg.register(LoRARef("a", "/srv/a2"), rank=9, host_bytes=10, device_bytes=10)  # ...and loads anew
    assert reg.finish_unload(handle) == 0  # done: the new "a" is not this unload's
    assert "a" in reg and reg.lora_ref("a").lora_path == "/srv/a2"
    assert reg.begin_unload("b") is None and "b" not in reg
    reg.audit()


def test_an_unload_timeout_too_long_for_a_clock_waits_without_failing() -> None:
    reg = make(names="ab")
    reg.unload("a", timeout=1e19)  # nothing in flight: done at once (was an overflow panic)
    assert "a" not in reg
    with pytest.raises(AdapterNotFoundError):
        reg.unload("never", timeout=1e19)


@pytest.mark.parametrize(("distinct", "length"), [(3, 200), (5, 30), (10, 200), (60, 200)])
def test_admitted_and_deferred_partition_the_requests(distinct: int, length: int) -> None:
    names = [f"n{i}" for i in range(distinct)]
    reg = LoRARegistry(4)
    for n in names:
        reg.register(LoRARef(n, f"/srv/{n}"), rank=2, host_bytes=1, device_bytes=1)
    rng = random.Random(distinct)
    for _ in range(10):
        step = [rng.choice(names) if rng.random() > 0.3 else None for _ in range(length)]
        plan = run(reg, step, 1)
        admitted, deferred = plan.admitted, plan.deferred
        assert sorted(admitted + deferred) == list(range(len(step)))
        assert admitted == sorted(admitted) and deferred == sorted(deferred)
        kept = {step[i] for i in admitted} - {None}
        assert len(kept) <= 4 and all(step[i] not in kept and step[i] is not None for i in deferred)
        slots = memoryview(plan.request_slots).cast("i").tolist()
        slot_of = {step[i]: s for i, s in zip(admitted, slots, strict=True)}
        assert len(slot_of) == len({step[i] for i in admitted})  # one slot per name
        assert slot_of.get(None, -1) == -1 and len(set(slot_of.values())) == len(slot_of)
        first = plan.admitted
        first.append(-1)  # a fresh list per read, built from a shared one that must stay intact
        assert plan.admitted == admitted


def test_many_cached_names_resolve_to_their_own_adapters() -> None:
    # More names than the cache's direct-mapped front has room for without collisions.
    names = [f"adapter-{i}" for i in range(700)]
    regs = [LoRARegistry(800) for _ in range(2)]
    for reg in regs:
        for i, n in enumerate(names):
            reg.register(LoRARef(n, f"/srv/{n}"), rank=1 + i % 50, host_bytes=1, device_bytes=1)
    rng = random.Random(7)
    for _ in range(5):
        step = rng.sample(names, 300) + rng.sample(names, 300)
        same, new = run(regs[0], step, 1), run(regs[1], [fresh(n) for n in step], 1)
        assert outputs(same) == outputs(new)
        assert [regs[0].lora_ref(n).lora_id for n, _, _, _ in same.loads] == [i for _, i, _, _ in same.loads]
