"""Ranks agree without a broadcast: the registry's plan is a pure function of its registrations and the
step's inputs.

Each tensor-parallel rank keeps its own registry and plans every step itself, so two registries fed the
same operations must make the same admissions, slots, loads and evictions, whatever the ids of their
adapters (a run-time load draws a random id) and whatever else runs in the process.
"""

from __future__ import annotations

import random

import pytest

from lora_pin._core import EVICTION_POLICIES, LoRARef, LoRARegistry


def _plan_record(plan: object) -> tuple[object, ...]:
    """Everything a plan decides, with the adapters' ids left out (names identify them)."""
    p: object = plan
    return (
        tuple(p.admitted),  # type: ignore[attr-defined]
        tuple(p.deferred),  # type: ignore[attr-defined]
        bytes(p.request_slots),  # type: ignore[attr-defined]
        bytes(p.token_perm),  # type: ignore[attr-defined]
        bytes(p.seg_indptr),  # type: ignore[attr-defined]
        bytes(p.seg_slots),  # type: ignore[attr-defined]
        bytes(p.slot_epochs),  # type: ignore[attr-defined]
        tuple((name, slot, source) for name, _id, slot, source in p.loads),  # type: ignore[attr-defined]
        tuple(p.evictions),  # type: ignore[attr-defined]
    )


def _run(policy: str, seed: int, names_order: list[str]) -> list[tuple[object, ...]]:
    """Drive one registry through a seeded workload; ``names_order`` is the registration order, the same
    set every time (hash maps keyed by name or id must not leak their iteration order into a plan)."""
    registry = LoRARegistry(4, 6, eviction_policy=policy)
    for name in names_order:
        registry.register(LoRARef.new(name, f"/adapters/{name}"), rank=8, host_bytes=1000, device_bytes=100)
    registry.pin(names_order[0])
    records: list[tuple[object, ...]] = []
    steps = random.Random(seed)
    for step in range(300):
        batch = [steps.choice([*names_order, None]) for _ in range(steps.randint(1, 8))]
        tokens = [steps.randint(1, 5) for _ in batch]
        plan = registry.begin_step(batch, tokens)
        records.append(_plan_record(plan))
        for index in range(len(plan.loads)):
            registry.report_load(plan.ticket, index, True)
        registry.finish_step(plan.ticket)
        if step % 50 == 49:
            victim = names_order[1 + steps.randrange(len(names_order) - 1)]
            registry.unload(victim)
            registry.register(
                LoRARef.new(victim, f"/adapters/{victim}"), rank=8, host_bytes=1000, device_bytes=100
            )
            records.append(("reloaded", victim))
    return records


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_two_registries_fed_the_same_operations_make_the_same_plans(policy: str) -> None:
    names = [f"adapter-{i}" for i in range(12)]
    first = _run(policy, 7, names)
    second = _run(policy, 7, names)
    assert first == second
    # A different workload makes different plans: the records do depend on the inputs.
    assert _run(policy, 8, names) != first
