"""``lora-pin simulate --replicas``: the replica table and ``--json``, its errors, and the replica loop
against the single-replica replay (one replica must decide exactly as ``simulate`` does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lora_pin._core import Trace, simulate, simulate_replicas
from lora_pin.cli import main

ROUTERS = ("random", "least-loaded", "affinity")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_one_replica_decides_as_the_single_replica_replay() -> None:
    trace = Trace.generate("zipf:1.0", adapters=100, requests=3000, seed=2).with_gamma_arrivals(150.0, cv=2.0)
    single = simulate(trace, slots=8, max_loaded_loras=32, policy="lru")
    for router in (*ROUTERS, "hash"):
        cluster = simulate_replicas(trace, replicas=1, router=router, slots=8, max_loaded_loras=32)
        (rep,) = cluster["replicas"]
        assert rep["device"] == single["device"], router
        assert (rep["uses"], rep["steps"], rep["routed"]) == (single["uses"], single["steps"], 3000)
        assert rep["host"]["misses"] == single["host"]["misses"]


def test_json_sums_the_replicas_and_affinity_loads_less_under_skew(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--workload", "zipf:1.0", "--adapters", "500", "--requests", "20000", "--replicas", "4,8"]
    code, out, err = _cli(capsys, *argv, "--slots", "16", "--host", "64", "--policy", "lru", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    rows = {(r["replicas"], r["router"]): r for r in doc["results"]}
    assert set(rows) == {(n, router) for n in (4, 8) for router in ROUTERS}
    for (n, _), r in rows.items():
        per = r["per_replica"]
        assert len(per) == n
        assert sum(p["routed"] for p in per) == 20000
        assert r["overall"]["loads"] == sum(p["device"]["misses"] for p in per)
        assert r["overall"]["queue_max"] == max(p["queue_max"] for p in per)
    for n in (4, 8):
        assert rows[n, "affinity"]["overall"]["loads"] < rows[n, "least-loaded"]["overall"]["loads"]


def test_table_has_a_block_per_replica_count(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(
        capsys, "--workload", "power:0.3", "--requests", "2000", "--replicas", "2", "--policy", "lru"
    )
    assert (code, err) == (0, "")
    assert out.count("replicas=2  slots=") == 2
    lines = out.splitlines()
    for router in ROUTERS:
        assert sum(line.startswith(router + " ") for line in lines) == 2
    assert sum(line.startswith("  replica-1 ") for line in lines) == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "2", "--router", "round-robin"], "--router: 'round-robin' is not a router"),
        (["--replicas", "0"], "--replicas: '0' is not an integer"),
        (["--replicas", "2", "--load-ms", "5"], "--load-ms: background loading is not modelled"),
        (["--replicas", "2", "--queue-bound", "0"], "--queue-bound: '0' is not an integer"),
        (["--replicas", "2", "--arrival-rate", "0"], "rate must be a finite number above 0"),
    ],
)
def test_bad_replica_arguments_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _cli(capsys, "--requests", "100", *argv)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # The Gamma shape 1/cv^2 rounds to 0 or to infinity: the sampler looped forever.
        (["--cv", "1e200"], "--cv: '1e200' is not a number in 1e-150..1e+150"),
        (["--cv", "1e-200"], "--cv: '1e-200' is not a number in 1e-150..1e+150"),
        (["--cv", "1e-160"], "--cv: '1e-160' is not a number in 1e-150..1e+150"),
        # A finite shape whose scale 1/(rate * shape) is infinite: NaN arrivals, and the replica loop
        # waited forever for the first of them.
        (
            ["--cv", "1e100", "--arrival-rate", "1e-300"],
            "--arrival-rate (1e-300 requests/s) with --cv 1e+100",
        ),
        (["--cv", "100", "--step-ms", "1.7e308"], "the rate from --step-ms and --batch-size"),
        # Gaps so long that the arrival times pass the largest float.
        (["--arrival-rate", "1e-306", "--requests", "2000"], "pass the largest"),
    ],
)
def test_arrival_parameters_that_leave_no_gamma_draw_exit_2_at_once(argv: list[str], message: str) -> None:
    """Each of these once hung the command; now it exits 2 at once naming the flags. The child is held to
    60 s, far more than the fixed command takes, so a hang fails the test instead of stalling it."""
    sweep = ["--requests", "200", "--adapters", "20", "--slots", "4", "--policy", "lru", "--router", "random"]
    done = subprocess.run(
        [sys.executable, "-m", "lora_pin", "simulate", *sweep, "--replicas", "1", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_plot_writes_an_image_of_the_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out_file = str(tmp_path / "sweep.png")
    argv = [
        "--requests",
        "2000",
        "--replicas",
        "2,4",
        "--slots",
        "4,8",
        "--host",
        "16,none",
        "--policy",
        "lru",
    ]
    code, _, err = _cli(capsys, *argv, "--plot", out_file)
    assert (code, err) == (0, "")
    with open(out_file, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes `import matplotlib` raise ImportError, as when it is not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = _cli(capsys, "--requests", "100", "--replicas", "2", "--plot", "x.png")
    assert (code, out) == (1, "")
    assert "lora_pin[plot]" in err and err.count("\n") == 1, err


def test_plot_needs_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "--requests", "100", "--plot", "x.png")
    assert code == 2 and out == "" and "--plot" in err and "--replicas" in err
