"""``benches/serve_load.py``'s workload of mixed ranks and its pools at equal memory (issue 37): the ranks
it gives its adapters are the simulator's for the same names, the adapters it makes have them, and each
pool gets the flags of the same device memory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from lora_pin._core import Trace, simulate
from lora_pin.errors import SpecError

MIX = "8:4,16:2,64:1"


@pytest.fixture(scope="module")
def bench(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("serve_load")


def test_rank_mix_parses_rank_weight_items_and_names_a_bad_one(bench: ModuleType) -> None:
    assert bench.rank_mix(bench._args(["--ranks", MIX])) == [(8, 4.0), (16, 2.0), (64, 1.0)]
    assert bench.rank_mix(bench._args(["--rank", "32"])) == [(32, 1.0)]
    with pytest.raises(SpecError, match="--ranks: 'x' is not a number"):
        bench.rank_mix(bench._args(["--ranks", "8:x,16"]))


def _simulated_rank(name: str) -> int:
    """The rank ``lora-pin simulate --ranks MIX`` gives ``name``, read off the bytes one load of it
    moves (a rank-64 adapter moving 64 KiB)."""
    trace = Trace.from_jsonl(json.dumps({"adapter": name, "tokens": 1}))
    ranks = [(8, 4.0), (16, 2.0), (64, 1.0)]
    report = simulate(trace, slots=1, ranks=ranks, adapter_bytes=64 << 10)
    assert report["device"]["misses"] == 1
    return int(report["device"]["bytes_moved"] >> 10)


def test_adapters_get_the_simulators_ranks_in_proportion(bench: ModuleType) -> None:
    names = [f"a{i:04d}" for i in range(512)]
    ranks = bench.adapter_ranks(bench._args(["--ranks", MIX]), names)
    assert ranks == bench.adapter_ranks(bench._args(["--ranks", MIX]), names)
    assert [_simulated_rank(n) for n in names[:24]] == ranks[:24]
    # 4:2:1 of 512 is 292.6 : 146.3 : 73.1; a hash draws within a few standard deviations of it.
    for rank, share in ((8, 4 / 7), (16, 2 / 7), (64, 1 / 7)):
        assert abs(ranks.count(rank) - share * 512) < 4 * (512 * share * (1 - share)) ** 0.5, rank
    assert bench.adapter_ranks(bench._args(["--rank", "32"]), names[:3]) == [32, 32, 32]


def test_each_pool_gets_the_memory_of_k_max_rank_slots(bench: ModuleType) -> None:
    args = bench._args(["--ranks", MIX, "--memory-slots", "8", "--page-rank", "8", "--host", "32"])
    slots = bench.pool_flags(args, "slots", 64, 1000)
    order = ["--admission-order", "arrival"]
    assert slots == ["--max-lora-rank", "64", *order, "--max-loras-per-batch", "8"]
    # The page pool gets the same bytes; its steps are bounded by its pages and the host tier alone.
    pages = bench.pool_flags(args, "pages", 64, 1000)
    assert pages == ["--max-lora-rank", "64", *order, "--page-rank", "8", "--max-lora-memory", "8000"]
    # A pool's admission order follows a slash.
    lrpt = bench.pool_flags(args, "pages/longest-remaining", 64, 1000)
    assert lrpt == ["--max-lora-rank", "64", "--admission-order", "longest-remaining", *pages[4:]]
    with pytest.raises(SystemExit, match="slots or pages"):
        bench.pool_flags(args, "pages/shortest", 64, 1000)
    # Without --memory-slots the slot pool has --slots slots; a page pool needs the memory.
    assert bench.pool_flags(bench._args(["--slots", "5"]), "slots", 16, 1)[-1] == "5"
    with pytest.raises(SystemExit, match="--memory-slots"):
        bench.pool_flags(bench._args([]), "pages", 16, 1)
    with pytest.raises(SystemExit, match="slots or pages"):
        bench.pool_flags(args, "slabs", 64, 1000)


def test_made_adapters_have_their_ranks_and_the_largest_sizes_a_slot(
    bench: ModuleType, tmp_path: Path
) -> None:
    args = bench._args(["--ranks", MIX, "--hidden", "64", "--layers", "1"])
    _, dirs, ranks = bench._make_model(tmp_path, args, 12)
    assert ranks == bench.adapter_ranks(args, [d.name for d in dirs]) and len(set(ranks)) > 1
    for folder, rank in zip(dirs, ranks, strict=True):
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == rank
        # q and v of one layer, hidden 64 in and out, float32: A [r, 64] and B [64, r] each.
        assert bench.adapter_bytes(folder) == 2 * 2 * rank * 64 * 4


def test_ranks_by_name_refuses_a_bad_mix_by_its_value() -> None:
    from lora_pin._core import ranks_by_name

    assert ranks_by_name(["a", "b"], []) == [16, 16]
    with pytest.raises(SpecError, match="rank 0 is not in 1"):
        ranks_by_name(["a"], [(0, 1.0)])
    with pytest.raises(SpecError, match="weight -1 is not a finite number above 0"):
        ranks_by_name(["a"], [(8, -1.0)])


def test_the_simulated_trace_is_the_served_workload_in_arrival_order(bench: ModuleType) -> None:
    args = bench._args(["--requests", "40", "--base-share", "0.3"])
    names = [f"a{i:04d}" for i in range(16)]
    workload = bench._workload(args, 16, names)
    trace = bench.simulated_trace(workload)
    got = trace.requests()
    assert [(name, tokens) for name, tokens, _ in got] == [(name, n) for _, name, _, n in workload]
    # The trace's JSON parser may round the last bit of a time differently.
    assert [at for _, _, at in got] == pytest.approx([at for at, _, _, _ in workload], rel=1e-15)
    assert None in [name for _, name, _, _ in workload]


def test_simulate_decode_holds_a_running_requests_adapter_for_its_tokens() -> None:
    trace = Trace.from_jsonl('{"adapter": "a", "tokens": 3}\n{"adapter": "b", "tokens": 2}')
    decoded = simulate(trace, slots=1, batch_size=8, decode=True)
    assert (decoded["steps"], decoded["deferrals"], decoded["tokens"]) == (5, 3, 5)
    whole = simulate(trace, slots=1, batch_size=8)
    assert (whole["steps"], whole["deferrals"], whole["tokens"]) == (2, 1, 5)
