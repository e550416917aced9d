"""``lora-pin simulate --ranks`` and ``--host-gib``: adapters of mixed ranks, sized in proportion, and a
host tier bounded in bytes, for one replica and for several."""

from __future__ import annotations

import json

import pytest

from lora_pin.cli import main

BASE = [
    "--workload",
    "zipf:1.0",
    "--adapters",
    "300",
    "--requests",
    "6000",
    "--slots",
    "8",
    "--policy",
    "lru",
]
MIB = 1 << 20


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    code = main(["simulate", *BASE, *argv, "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    results: list[dict] = json.loads(out)["results"]
    return results


def test_one_rank_moves_its_size_per_miss_and_a_mix_moves_less(capsys: pytest.CaptureFixture[str]) -> None:
    (one,) = _json(capsys, "--host", "32", "--ranks", "64", "--adapter-mb", "16")
    assert one["ranks"] == [[64, 1.0]]
    for tier in ("device", "host"):
        assert one[tier]["bytes_moved"] == one[tier]["misses"] * 16 * MIB
    (mixed,) = _json(capsys, "--host", "32", "--ranks", "8:3,64:1", "--adapter-mb", "16")
    assert mixed["device"]["misses"] == one["device"]["misses"]  # sizes do not change a slot's use
    assert mixed["device"]["bytes_moved"] < mixed["device"]["misses"] * 16 * MIB


def test_a_host_tier_in_gib_holds_as_many_adapters_as_fit(capsys: pytest.CaptureFixture[str]) -> None:
    (by_count,) = _json(capsys, "--host", "20", "--adapter-mb", "32")
    (by_bytes,) = _json(capsys, "--host-gib", "0.625", "--adapter-mb", "32")  # 20 adapters of 32 MiB
    assert by_bytes["max_host_bytes"] == 20 * 32 * MIB
    assert by_bytes["host"]["misses"] == by_count["host"]["misses"] > 0
    (small,) = _json(capsys, "--host-gib", "0.625", "--adapter-mb", "32", "--ranks", "8:3,64:1")
    assert small["host"]["misses"] < by_bytes["host"]["misses"]


def test_replicas_take_the_sizes_too(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--replicas", "2", "--router", "affinity", "--ranks", "8,64", "--host-gib", "1"]
    (row,) = _json(capsys, *argv)
    assert row["ranks"] == [[8, 1.0], [64, 1.0]] and row["max_host_bytes"] == 1 << 30
    for rep in row["per_replica"]:
        assert rep["device"]["bytes_moved"] < rep["device"]["misses"] * 32 * MIB


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "8,,16"], "--ranks: '8,,16' has an empty item"),
        (["--ranks", "0"], "--ranks: '0' is not an integer"),
        (["--ranks", "8:x"], "--ranks: 'x' is not a number"),
        (["--ranks", "8:0"], "--ranks: '8:0' has a weight of 0"),
        (["--host-gib", "-1"], "--host-gib: '-1' is not a number"),
    ],
)
def test_bad_sizes_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = main(["simulate", "--requests", "100", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and message in err, err
