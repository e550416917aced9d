"""``lora-pin simulate`` and ``lora_pin._core.simulate``: the CLI's table and ``--json``, its exit codes,
JSONL traces, and the simulator against the live ``LoRARegistry`` driven the way ``LoRAManager`` drives it."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from lora_pin._core import LoRARef, LoRARegistry, Trace, simulate
from lora_pin.args import EVICTION_POLICIES
from lora_pin.cli import main

POLICIES = ("lru", "fifo", "reuse", "hybrid", "size")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_every_policy_beside_belady(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "--workload", "scan", "--requests", "4000", "--slots", "8,16")
    assert (code, err) == (0, "")
    assert out.startswith("trace: scan, 4000 requests over 128 adapters\n")
    assert out.count("slots=8  host=unbounded") == 1 and out.count("slots=16  host=unbounded") == 1
    rows = {(line.split()[0], i) for i, block in enumerate(out.split("\n\n")) for line in block.splitlines()}
    assert {(p, i) for p in POLICIES for i in (0, 1)} <= rows
    # A cyclic sweep: LRU and FIFO never hit; the bound and reuse keep (slots - batch) of 128 adapters.
    for line in out.splitlines():
        if line.startswith(("lru ", "fifo ")):
            assert line.split()[1] == "0.00%", line
    trace = Trace.generate("scan", adapters=128, requests=4000)
    for slots in (8, 16):
        r = simulate(trace, slots=slots, policy="reuse")
        assert r["device"]["hit_rate"] == pytest.approx(r["device"]["belady_hit_rate"])
        assert r["device"]["hit_rate"] == pytest.approx((slots - 4) / 128, abs=0.01)


def test_json_matches_the_core_and_respects_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "zipf:1.1", "--requests", "3000", "--adapters", "40", "--seed", "3"]
    code, out, _ = run_cli(capsys, *argv, "--slots", "4,8", "--host", "none,12", "--pin-top", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["trace"] == {"workload": "zipf:1.1", "requests": 3000, "adapters": 40, "seed": 3}
    results: list[dict[str, Any]] = doc["results"]
    assert [(r["slots"], r["max_loaded_loras"], r["policy"]) for r in results] == [
        (s, h, p) for s in (4, 8) for h in (None, 12) for p in POLICIES
    ]
    trace = Trace.generate("zipf:1.1", adapters=40, requests=3000, seed=3)
    top = trace.most_requested(2)
    for r in results:
        assert r["pins"] == top
        direct = simulate(
            trace, slots=r["slots"], max_loaded_loras=r["max_loaded_loras"], policy=r["policy"], pins=top
        )
        assert {
            k: v
            for k, v in r.items()
            if k
            not in (
                "slots",
                "max_loaded_loras",
                "pins",
                "policy",
                "load_ms",
                "ranks",
                "max_host_bytes",
                "decode",
                "order",
            )
        } == direct
        dev, host = r["device"], r["host"]
        assert dev["hits"] + dev["misses"] == r["uses"]
        assert dev["misses"] >= dev["belady_misses"]
        assert dev["hit_rate"] <= dev["belady_hit_rate"]
        assert dev["bytes_moved"] == dev["misses"] * 32 * 2**20
        assert (host["belady_misses"] is None) == (r["max_loaded_loras"] is None)
        if host["belady_misses"] is not None:
            assert host["misses"] >= host["belady_misses"]
        assert r["requests"] == r["tokens"] == 3000


def test_jsonl_trace_with_base_rows_and_arrivals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [{"adapter": n, "tokens": 5, "arrival": i * 0.01} for i, n in enumerate("abcabcab")]
    lines.insert(3, {"adapter": None, "tokens": 2})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, _ = run_cli(capsys, "--trace", str(path), "--slots", "2", "--batch-size", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["trace"] == {"file": str(path), "requests": 9, "adapters": 3}
    for r in doc["results"]:
        assert (r["requests"], r["adapter_requests"], r["tokens"], r["uses"]) == (9, 8, 42, 8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slots", "8,x"], "--slots: 'x' is not an integer in 1..65536"),
        (["--slots", "0"], "--slots: '0' is not an integer in 1..65536"),
        (["--slots", "100000"], "--slots: '100000' is not an integer in 1..65536"),
        (["--seed", "9" * 25], "--seed: '" + "9" * 25 + "' is not an integer in 0..18446744073709551615"),
        (
            ["--adapters", "1" + "0" * 20],
            "--adapters: '1" + "0" * 20 + "' is not an integer in 1..4294967295",
        ),
        (["--pin-top", "9" * 20], "is not an integer in 0.."),
        (["--adapter-mb", "1e14"], "--adapter-mb: '1e14' is not a number in 0..8.79609e+12"),
        (["--batch-size", str(10**18)], None),
        (["--requests", str(10**18)], "cannot be allocated"),
        (["--slots", "8,,16"], "--slots: '8,,16' has an empty item"),
        (["--workload", "zipf:-1"], "ALPHA must be a finite number above 0"),
        (["--workload", "loop"], 'workload "loop" is not a workload'),
        (["--policy", "lru,lfu"], "--policy: 'lfu' is not an eviction policy"),
        (["--pin", "nobody"], 'cannot pin adapter "nobody": the trace never names it'),
        (["--slots", "2", "--pin-top", "2"], "cannot pin adapter"),
        (["--slots", "4", "--host", "2"], "max_loaded_loras"),
        (["--batch-size", "0"], "--batch-size: '0' is not an integer in 1.."),
        (["--step-ms", "-1"], "--step-ms: '-1' is not a number in 0..inf"),
        (["--load-ms", "-5"], "--load-ms: '-5' is not a number in 0..inf"),
        (["--load-ms", "inf"], "--load-ms: 'inf' is not a number in 0..inf"),
        (["--trace", "/nonexistent/t.jsonl"], '--trace: cannot read the trace file "/nonexistent/t.jsonl"'),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str | None
) -> None:
    code, out, err = run_cli(capsys, "--requests", "50", *argv)
    if message is None:  # a value that is merely large: it runs (it aborted the process once)
        assert code == 0, err
        return
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("lora-pin simulate: error: ")
    assert message in err, err


def _simulate_in_a_child(trace: str) -> subprocess.CompletedProcess[str]:
    """``lora-pin simulate --trace trace`` in a child held to 2 GiB of address space and 60 s: what once
    read ``/dev/zero`` until memory ran out, or waited for a FIFO's writer forever, fails the test instead."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-m", "lora_pin", "simulate", "--trace", trace, "--requests", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
        check=False,
    )


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "too large"])
def test_a_trace_that_is_not_a_regular_file_of_bounded_size_is_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    if kind == "fifo":
        path = tmp_path / "trace.fifo"
        os.mkfifo(path)
        trace, message = str(path), "is not a regular file"
    elif kind == "device":
        trace, message = "/dev/zero", "is not a regular file"
    elif kind == "folder":
        trace, message = str(tmp_path), "is not a regular file"
    else:
        path = tmp_path / "big.jsonl"
        with open(path, "wb") as f:
            f.truncate((256 << 20) + 1)  # sparse: no disk used
        trace, message = str(path), f"is larger than {256 << 20} bytes"
    done = _simulate_in_a_child(trace)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("lora-pin simulate: error: --trace: ")
    assert f'the trace file "{trace}" {message}' in done.stderr, done.stderr


def test_a_malformed_trace_names_the_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"adapter": "a", "tokens": 1}\n{"adapter": "a", "tokens": "many"}\n')
    code, _, err = run_cli(capsys, "--trace", str(path))
    assert code == 2
    assert f'{path}:2: field "tokens" must be an integer' in err


def test_the_serving_args_accept_the_new_policy() -> None:
    assert EVICTION_POLICIES == POLICIES
    for policy in ("reuse", "hybrid"):
        LoRARegistry(4, eviction_policy=policy, host_eviction_policy=policy)


def live_log(
    trace: Trace, *, slots: int, max_loaded: int | None, policy: str, pins: list[str], batch: int
) -> list[Any]:
    """The live path, written here without the simulator: a ``LoRARegistry`` driven like ``LoRAManager``
    (plan the step's names, acquire the admitted ones, report each load done, release), deferred
    requests first in the next step."""
    reg = LoRARegistry(slots, max_loaded, eviction_policy=policy, host_eviction_policy=policy)
    names = trace.names
    for n in [n for n in names if n in pins] + [n for n in names if n not in pins]:
        reg.register(LoRARef.new(n, f"sim://{n}", n in pins), rank=16, host_bytes=2**25, device_bytes=2**25)
    requests = trace.requests()
    waiting: deque[int] = deque()
    nxt = 0
    log = []
    while nxt < len(requests) or waiting:
        while len(waiting) < batch and nxt < len(requests):
            waiting.append(nxt)
            nxt += 1
        step = list(waiting)
        waiting.clear()
        step_names = [requests[i][0] for i in step]
        plan = reg.begin_step(step_names, [requests[i][1] for i in step])
        for index in range(len(plan.loads)):
            reg.report_load(plan.ticket, index, True)
        reg.finish_step(plan.ticket)
        waiting.extend(step[i] for i in plan.deferred)
        log.append(
            {
                "batch": step,
                "admitted": plan.admitted,
                "deferred": plan.deferred,
                "loads": [(n, slot, src) for n, _i, slot, src in plan.loads],
                "evictions": [(n, tier, None if slot < 0 else slot) for n, tier, slot in plan.evictions],
                "to_fetch": [],
            }
        )
    reg.audit()
    return log


def live_background_log(
    trace: Trace, *, slots: int, max_loaded: int, policy: str, batch: int, step_ms: int, load_ms: int
) -> list[Any]:
    """``live_log`` in background mode, again without the simulator: steps begin with ``fetch=True``, a
    fetch begun at step time t is reported done at the first step at or after t + load_ms, and when a
    step admits nothing the loop waits for the next fetch instead of counting a step."""
    reg = LoRARegistry(slots, max_loaded, eviction_policy=policy, host_eviction_policy=policy)
    for n in trace.names:
        reg.register(LoRARef.new(n, f"sim://{n}"), rank=16, host_bytes=2**25, device_bytes=2**25)
    requests = trace.requests()
    waiting: deque[int] = deque()
    pending: deque[tuple[int, str, int]] = deque()
    nxt = clock = 0
    log = []
    while nxt < len(requests) or waiting:
        while len(waiting) < batch and nxt < len(requests):
            waiting.append(nxt)
            nxt += 1
        while pending and pending[0][0] <= clock:
            _, name, serial = pending.popleft()
            reg.fetch_done(name, serial)
        step = list(waiting)
        waiting.clear()
        plan = reg.begin_step([requests[i][0] for i in step], [requests[i][1] for i in step], "fetch")
        assert plan.ticket is not None
        for index in range(len(plan.loads)):
            reg.report_load(plan.ticket, index, True)
        reg.finish_step(plan.ticket)
        pending.extend((clock + load_ms, name, serial) for name, serial in plan.to_fetch)
        waiting.extend(step[i] for i in plan.deferred)
        if not plan.admitted:
            clock = max(clock, pending[0][0])
            continue
        log.append(
            {
                "batch": step,
                "admitted": plan.admitted,
                "deferred": plan.deferred,
                "loads": [(n, slot, src) for n, _i, slot, src in plan.loads],
                "evictions": [(n, tier, None if slot < 0 else slot) for n, tier, slot in plan.evictions],
                "to_fetch": [n for n, _ in plan.to_fetch],
            }
        )
        clock += step_ms
    reg.audit()
    return log


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
@pytest.mark.parametrize(("slots", "max_loaded", "batch", "load_ms"), [(4, 6, 6, 50), (2, 2, 3, 30)])
def test_background_mode_decides_exactly_as_the_live_registry(
    policy: str, slots: int, max_loaded: int, batch: int, load_ms: int
) -> None:
    trace = Trace.generate("zipf:0.9", adapters=20, requests=1200, seed=11)
    sim = simulate(
        trace,
        slots=slots,
        max_loaded_loras=max_loaded,
        policy=policy,
        batch_size=batch,
        step_seconds=0.02,
        load_ms=load_ms,
        record=True,
    )
    live = live_background_log(
        trace, slots=slots, max_loaded=max_loaded, policy=policy, batch=batch, step_ms=20, load_ms=load_ms
    )
    assert len(sim["steps_log"]) == len(live) == sim["steps"]
    for t, (s, lv) in enumerate(zip(sim["steps_log"], live, strict=True)):
        assert s == lv, f"step {t}"
    assert all(src == "host" for s in live for *_, src in s["loads"]), "a disk read on a step's path"
    fetched = sum(len(s["to_fetch"]) for s in live)
    assert 0 < fetched <= sim["fetch"]["fetches"] == sim["host"]["misses"]


def test_load_ms_reports_the_requests_deferred_by_fetches(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "zipf:1.0", "--requests", "2000", "--adapters", "30", "--slots", "4", "--host", "6"]
    code, out, _ = run_cli(capsys, *argv, "--policy", "lru", "--load-ms", "50", "--json")
    assert code == 0
    (row,) = json.loads(out)["results"]
    assert row["load_ms"] == 50.0
    direct = simulate(
        Trace.generate("zipf:1.0", adapters=30, requests=2000),
        slots=4,
        max_loaded_loras=6,
        policy="lru",
        load_ms=50,
    )
    assert row["fetch"] == direct["fetch"]
    f = row["fetch"]
    assert f["fetches"] == row["host"]["misses"] > 0
    assert 0 < f["deferred_requests"] <= row["deferrals"]
    assert 0 < f["wait_ms_mean"] <= f["wait_ms_p99"] and f["wait_steps_mean"] <= f["wait_steps_p99"]
    code, out, _ = run_cli(capsys, *argv, "--policy", "lru", "--load-ms", "50")
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    assert header.split()[-6:] == ["by", "fetch", "wait", "ms", "wait", "steps"]
    line = next(line for line in out.splitlines() if line.startswith("lru"))
    assert line.split()[10] == str(row["worst_wait"])
    assert line.split()[11] == str(f["deferred_requests"])
    assert line.split()[12:15] == [f"{f['wait_ms_mean']:.1f}", "/", f"{f['wait_ms_p99']:.1f}"]
    # Blocking mode (the default) keeps the table as it was, and reads in the step.
    code, out, _ = run_cli(capsys, *argv, "--policy", "lru")
    assert "by fetch" not in out
    blocking = simulate(Trace.generate("zipf:1.0", adapters=30, requests=2000), slots=4, max_loaded_loras=6)
    assert blocking["fetch"] == dict.fromkeys(f, 0) and blocking["host"]["misses"] > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("workload", "slots", "max_loaded", "pin_top", "batch"),
    [
        ("zipf:0.8", 4, None, 1, 6),
        ("bursty", 3, 5, 0, 3),
        ("shifting", 5, 7, 2, 8),
    ],
)
def test_the_simulator_decides_exactly_as_the_live_registry(
    policy: str, workload: str, slots: int, max_loaded: int | None, pin_top: int, batch: int
) -> None:
    trace = Trace.generate(workload, adapters=20, requests=1500, seed=5)
    pins = trace.most_requested(pin_top)
    sim = simulate(
        trace,
        slots=slots,
        max_loaded_loras=max_loaded,
        policy=policy,
        pins=pins,
        batch_size=batch,
        record=True,
    )
    live = live_log(trace, slots=slots, max_loaded=max_loaded, policy=policy, pins=pins, batch=batch)
    assert len(sim["steps_log"]) == len(live) == sim["steps"]
    for t, (s, lv) in enumerate(zip(sim["steps_log"], live, strict=True)):
        assert s == lv, f"step {t}"
    evicted = [e for s in live for e in s["evictions"]]
    assert evicted, "the trace must exercise eviction"
    assert not [e for e in evicted if e[0] in pins], "a pinned adapter was evicted"
