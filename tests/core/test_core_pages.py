"""The rank-paged device tier through the Python face: page tables in the plan, the page budget,
pins and registrations refused with the numbers, and a random run checked against a plain model
(pages counted here with integer arithmetic, not with the core)."""

from __future__ import annotations

import array
import random

import pytest

from lora_pin._core import LoRARef, LoRARegistry, StepPlan
from lora_pin.errors import CapacityError, SpecError

PAGE_RANK = 8


def pages_of(rank: int) -> int:
    return -(-rank // PAGE_RANK)


def paged(pages: int, ranks: list[int], slots: int | None = None) -> LoRARegistry:
    reg = LoRARegistry(slots, page_rank=PAGE_RANK, max_lora_memory=pages)
    for i, rank in enumerate(ranks):
        reg.register(LoRARef(f"a{i}", f"/srv/a{i}"), rank=rank, host_bytes=rank, device_bytes=rank)
    return reg


def run(reg: LoRARegistry, names: list[str | None]) -> StepPlan:
    plan = reg.begin_step(names, 1)
    for index in range(len(plan.loads)):
        reg.report_load(plan.ticket, index, True)  # type: ignore[arg-type]
    reg.finish_step(plan.ticket)  # type: ignore[arg-type]
    reg.audit()
    return plan


def ints(buf: bytearray) -> list[int]:
    return array.array("i", bytes(buf)).tolist()


def tables(plan: StepPlan) -> dict[int, list[int]]:
    """Per admitted request index, its adapter's page table."""
    indptr, table = ints(plan.page_indptr), ints(plan.page_table)
    slots = ints(plan.request_slots)
    return {r: table[indptr[s] : indptr[s + 1]] for r, s in zip(plan.admitted, slots, strict=True)}


def test_the_plan_gives_each_adapter_its_page_table() -> None:
    reg = paged(8, [8, 24, 9])
    assert (reg.page_rank, reg.max_lora_memory, reg.max_loras_per_batch) == (8, 8, 8)
    plan = run(reg, ["a0", "a1", None, "a2"])
    assert plan.admitted == [0, 1, 2, 3]
    assert tables(plan) == {0: [0], 1: [1, 2, 3], 2: [], 3: [4, 5]}
    # The slot arrays have one entry per page: the adapter's rank sits at its first page.
    assert ints(plan.slot_ranks) == [8, 24, 0, 0, 9, 0, 0, 0]
    device = reg.stats()["device"]
    assert (device["pages"], device["max_pages"]) == (6, 8)
    place = reg.placement()
    assert (place["slots"], place["free_slots"]) == (8, 2)


def test_slot_mode_is_one_page_per_slot() -> None:
    reg = LoRARegistry(2)
    for n in "ab":
        reg.register(LoRARef(n, f"/srv/{n}"), rank=64, host_bytes=1, device_bytes=1)
    plan = run(reg, ["b", "a"])
    assert (ints(plan.page_indptr), ints(plan.page_table)) == ([0, 1, 2], [0, 1])
    assert (reg.page_rank, reg.max_lora_memory) == (None, None)


def test_the_budget_defers_what_the_pages_cannot_hold() -> None:
    reg = paged(6, [32, 24, 8])
    plan = run(reg, ["a0", "a1", "a2"])
    assert (plan.admitted, plan.deferred, plan.reasons) == ([0, 2], [1], ["device_room"])
    assert reg.split(["a0", "a1", "a2"]) == [[0], [1, 2]]


def test_a_count_bound_still_holds_beside_the_pages() -> None:
    reg = paged(16, [8, 8, 8], slots=2)
    plan = run(reg, ["a0", "a1", "a2"])
    assert plan.admitted == [0, 1]


def test_pins_and_registrations_that_could_never_fit_are_refused_with_the_numbers() -> None:
    reg = paged(10, [16, 24, 40, 32])
    reg.pin("a0")
    reg.pin("a1")
    with pytest.raises(CapacityError, match=r'"a3".*9 of max_lora_memory=10 pages.*"a2" needs 5'):
        reg.pin("a3")
    assert reg.stats()["pinned_names"] == ["a0", "a1"]
    with pytest.raises(CapacityError, match=r"needs 6 page\(s\).*leaving 5"):
        reg.register(LoRARef("big", "/srv/big"), rank=48, host_bytes=1, device_bytes=1)
    assert "big" not in reg
    reg.audit()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"page_rank": 8}, "go together"),
        ({"max_lora_memory": 8}, "go together"),
        ({"page_rank": 0, "max_lora_memory": 8}, "page_rank must be at least 1"),
        ({"page_rank": 8, "max_lora_memory": 0}, "max_lora_memory must be at least 1"),
        ({"page_rank": 8, "max_lora_memory": 1 << 17}, "max_lora_memory must be 1 to 65536"),
        ({}, "max_loras_per_batch is required"),
    ],
)
def test_bad_paging_is_refused_by_name(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        LoRARegistry(None, **kwargs)  # type: ignore[arg-type]


def test_a_random_run_matches_a_plain_model() -> None:
    rng = random.Random(37)
    for _ in range(20):
        pages = rng.randint(8, 24)
        ranks = [rng.randint(1, 4 * pages) for _ in range(rng.randint(3, 9))]
        reg = paged(pages, ranks)
        pinned = {i for i in rng.sample(range(len(ranks)), 1) if pages_of(ranks[i]) * 2 <= pages // 2}
        for i in pinned:
            reg.pin(f"a{i}")
        pinned_pages = sum(pages_of(ranks[i]) for i in pinned)
        for _ in range(30):
            names = [rng.randrange(len(ranks)) for _ in range(rng.randint(1, 8))]
            plan = run(reg, [f"a{i}" for i in names])
            owner: dict[int, int] = {}
            used = 0
            for r, table in tables(plan).items():
                i = names[r]
                assert len(table) == pages_of(ranks[i])
                for p in table:
                    assert 0 <= p < pages
                    assert owner.setdefault(p, i) == i, f"page {p} shared"
            step = {names[r] for r in plan.admitted}
            used = sum(pages_of(ranks[i]) for i in step - pinned)
            assert used <= pages - pinned_pages
            for r, why in zip(plan.deferred, plan.reasons, strict=True):
                if why == "device_room":
                    assert used + pages_of(ranks[names[r]]) > pages - pinned_pages
            assert not {e[0] for e in plan.evictions} & {f"a{i}" for i in pinned}
            resident = reg.stats()["device"]["resident"]
            assert reg.stats()["device"]["pages"] == sum(pages_of(ranks[int(n[1:])]) for n in resident)
