"""``benches/page_limits.py`` (issue 37): its memory bound is a lower bound of what the simulator runs, and
with nothing bounding a step's adapters, serve_load's 512-adapter workloads take the 8-adapter steps."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("page_limits")


def test_memory_bound_holds_and_unbounded_pools_cost_no_steps(bench: ModuleType) -> None:
    args = bench._parser().parse_args(
        ["--seeds", "2", "--pages", "60,90,none", "--host", "32,64", "--order", "arrival,longest_remaining"]
    )
    rows = {(r.pages, r.host, r.order): r for r in bench.grid(args)}
    for (pages, _, _), row in rows.items():
        assert row.at8 > 0 and row.at512 > 0
        if pages != bench.UNBOUNDED:
            assert row.bound is not None and 0 < row.bound <= row.at512, row
    # Pages and a host tier for every adapter in flight: 512 adapters run the 8-adapter steps.
    for order in ("arrival", "longest_remaining"):
        free = rows[(bench.UNBOUNDED, 64, order)]
        assert free.at512 == free.at8
    # The memory (8 rank-64 slots: 60 pages) costs steps at 512 adapters in arrival order;
    # longest remaining first takes fewer.
    arrival, longest = rows[(60, 64, "arrival")], rows[(60, 64, "longest_remaining")]
    assert arrival.at512 > arrival.at8
    assert longest.at512 < arrival.at512
