"""``lora-pin simulate --memory-gib``: a slot pool and a page pool of the same device bytes, side by
side, and ``--plot`` of the sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_pin.cli import main

BASE = [
    "--workload",
    "zipf:1.0",
    "--adapters",
    "512",
    "--requests",
    "6000",
    "--batch-size",
    "64",
    "--ranks",
    "8:4,16:2,64:1",
    "--adapter-mb",
    "32",
    "--policy",
    "lru",
]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *BASE, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_equal_bytes_give_max_rank_slots_and_rank_pages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "--memory-gib", "0.25,0.5", "--json")
    assert (code, err) == (0, "")
    rows = json.loads(out)["results"]
    shapes = [(r["memory_gib"], r["pool"], r["slots"], r["pages"], r["page_rank"]) for r in rows]
    # 0.25 GiB: 8 slots of a 32 MiB rank-64 adapter, or 64 pages of 4 MiB (rank 8).
    assert shapes == [
        (0.25, "slots", 8, None, None),
        (0.25, "pages", 64, 64, 8),
        (0.5, "slots", 16, None, None),
        (0.5, "pages", 128, 128, 8),
    ]
    for slots, pages in zip(rows[::2], rows[1::2], strict=True):
        assert pages["adapters_per_step"] > 2 * slots["adapters_per_step"]
        assert pages["deferrals"] * 3 < slots["deferrals"]
        assert slots["adapters_per_step"] <= slots["slots"]
        # Belady over the pages counted as rank-8 places: a lower bound no policy beats.
        assert 0 < pages["device"]["belady_misses"] <= pages["device"]["misses"]
        assert slots["device"]["belady_misses"] <= slots["device"]["misses"]
        assert pages["requests"] == slots["requests"] == 6000


def test_the_table_names_both_pools(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "--memory-gib", "0.25", "--page-rank", "16")
    assert (code, err) == (0, "")
    assert "device memory=0.25 GiB" in out
    assert "8 slots" in out and "32 x r16" in out
    assert "fewest" in out and ">=" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--memory-gib", "0.01"], "holds no max-rank slot"),
        (["--memory-gib", "1", "--page-rank", "0"], "--page-rank"),
        (["--memory-gib", "1", "--replicas", "2"], "leave out --replicas"),
        (["--memory-gib", "1", "--host", "16,32"], "one --host value"),
    ],
)
def test_bad_memory_arguments_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], match: str
) -> None:
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == "" and match in err, err


def test_plot_draws_loads_and_hit_rate_against_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out_file = str(tmp_path / "memory.png")
    code, _, err = _cli(capsys, "--requests", "1000", "--memory-gib", "0.25,0.5", "--plot", out_file)
    assert (code, err) == (0, "")
    assert Path(out_file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _burst(path: Path) -> Path:
    """A burst like serve_load's: 64 requests over 40 adapters of mixed ranks, 8 to 32 output tokens,
    all arriving within the first 0.1 s (5 steps of 20 ms)."""
    lines = [
        json.dumps({"adapter": f"a{(i * 7) % 40:02d}", "tokens": 8 + (i * 11) % 25, "arrival": i / 640})
        for i in range(64)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_decode_and_the_admission_order_reach_the_replay(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--decode`` runs each request's tokens as steps; ``--admission-order longest-remaining`` offers
    by tokens left. On a burst short of pages it takes fewer steps than arrival order, both serving
    every token; the rows say which they ran."""
    trace = _burst(tmp_path / "burst.jsonl")
    flags = ["--trace", str(trace), "--memory-gib", "0.25", "--host", "64", "--json", "--decode"]
    runs = {}
    for order in ("arrival", "longest-remaining"):
        code = main(["simulate", "--batch-size", "64", "--ranks", "8:4,16:2,64:1", "--adapter-mb", "32",
                     "--policy", "lru", *flags, "--admission-order", order])  # fmt: skip
        out, err = capsys.readouterr()
        assert (code, err) == (0, "")
        runs[order] = {r["pool"]: r for r in json.loads(out)["results"]}
    tokens = sum(8 + (i * 11) % 25 for i in range(64))
    for order, rows in runs.items():
        for row in rows.values():
            assert (row["decode"], row["order"], row["tokens"]) == (True, order.replace("-", "_"), tokens)
    # 40 adapters need ~90 pages of the 64: arrival order runs 53 steps, longest remaining first 37, the
    # longest request's 32 tokens after the burst's 5 steps of arrivals.
    assert 32 <= runs["longest-remaining"]["pages"]["steps"] < runs["arrival"]["pages"]["steps"]
    # Without --decode a request is served in one step.
    code = main(["simulate", "--batch-size", "64", "--policy", "lru", "--trace", str(trace), "--json"])
    whole = json.loads(capsys.readouterr()[0])["results"][0]
    assert (code, whole["decode"], whole["tokens"]) == (0, False, tokens)


def test_decode_is_refused_with_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", *BASE, "--replicas", "2", "--decode"])
    assert code == 2 and "--replicas" in capsys.readouterr().err
