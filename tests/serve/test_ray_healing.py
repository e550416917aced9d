"""``lora-pin serve --replicas`` when replicas die, stall or drift (``deployment`` in conftest.py: two
replicas of the tiny model on a local Ray cluster): a replica started again reaches exactly the desired
adapters, a replica whose adapters differ is sent them again, no registered adapter's request gets a 404
meanwhile, ``/health`` answers from the live replica, and a request lost with its replica is answered by
another one (or, for a stream already started, ends with an error event)."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

if TYPE_CHECKING:
    from pathlib import Path

    from conftest import Deployment


def _models(deployment: Deployment, replaced: dict[str, Path] | None = None) -> dict[str, Path | None]:
    """Every model the deployment serves now, each with the folder PEFT's answers come from."""
    folders: dict[str, Path | None] = {"tiny": None}
    for name in deployment.desired()["adapters"]:
        folders[name] = (replaced or {}).get(name, deployment.dirs[name])
    return folders


def _assert_replicas_hold_the_desired_adapters(deployment: Deployment) -> None:
    """Every replica serves the desired adapters, with their pins and the same weights (digests)."""
    reports = deployment.converged()
    desired = deployment.desired()["adapters"]
    adapters = deployment.adapters()
    assert set(adapters) == set(reports)
    for name, report in reports.items():
        assert set(report["serves"]) == set(desired), (name, report)
        for adapter, want in desired.items():
            assert report["serves"][adapter]["pinned"] == want["pinned"], (name, adapter, report)
            assert adapters[name][adapter]["pinned"] == want["pinned"], (name, adapter)
    for adapter in desired:
        digests = {name: held[adapter]["digest"] for name, held in adapters.items()}
        assert len(set(digests.values())) == 1, (adapter, digests)


def test_a_replica_that_drifted_is_sent_the_desired_adapters_again(deployment: Deployment) -> None:
    _assert_replicas_hold_the_desired_adapters(deployment)
    _, drifted = deployment.complete("ad2", deployment.prompt(0))  # where ad2's requests go
    with deployment.traffic(_models(deployment)) as wrong:
        # Changes on one replica that the ingress did not make: what a replica that missed changes holds.
        assert deployment.behind_the_back(drifted, "/v1/unload_lora_adapter", {"lora_name": "ad2"}) == 200
        assert deployment.behind_the_back(drifted, "/v1/unpin_lora_adapter", {"lora_name": "pin0"}) == 200
        report = deployment.call(drifted, "report")
        assert "ad2" not in report["serves"] and not report["serves"]["pin0"]["pinned"], report
        # The ingress sees the difference in the replica's report and sends the desired adapters again.
        _assert_replicas_hold_the_desired_adapters(deployment)
    assert not wrong, wrong[:5]


def test_a_restarted_replica_reaches_exactly_the_desired_adapters(deployment: Deployment) -> None:
    def post(path: str, body: dict[str, Any]) -> None:
        status, answer = deployment.http(path, "POST", body)
        assert status == 200, (path, answer)

    # At run time: a start-up pin undone, its room taken by a pinned load, a start-up adapter unloaded
    # and another one's weights replaced in place (all while every start-up pin filled the room).
    desired = deployment.desired()["adapters"]
    assert desired["pin1"]["pinned"]
    post("/v1/unpin_lora_adapter", {"lora_name": "pin1"})
    late = str(deployment.dirs["late"])
    post("/load_lora_adapter", {"lora_name": "late", "lora_path": late, "pinned": True})
    post("/v1/unload_lora_adapter", {"lora_name": "ad1"})
    ad2b = deployment.dirs["ad2b"]
    post("/v1/load_lora_adapter", {"lora_name": "ad2", "lora_path": str(ad2b), "load_inplace": True})
    _assert_replicas_hold_the_desired_adapters(deployment)

    with deployment.traffic(_models(deployment, {"ad2": ad2b})) as wrong:
        # Each of the replicas that took the changes, one after the other: then none is left of them.
        for victim in deployment.names():
            deployment.kill(victim)
            # While it is dead (or being replaced), /health answers from the live replica.
            status, body = deployment.http("/health", timeout=60)
            assert status == 200, body
            deployment.wait_for(
                f"a replica in place of {victim}", lambda v=victim: v not in deployment.names()
            )
            _assert_replicas_hold_the_desired_adapters(deployment)
    assert not wrong, wrong[:5]
    reports = deployment.converged()
    for report in reports.values():
        assert report["serves"]["late"]["pinned"] and not report["serves"]["pin1"]["pinned"], report
        assert "ad1" not in report["serves"], report


def test_health_answers_from_the_live_replica_while_one_is_stuck(deployment: Deployment) -> None:
    stuck, live = sorted(deployment.converged())
    with deployment.frozen(stuck):
        status, body = deployment.http("/health", timeout=120)
    assert status == 200, body
    # The stuck one is named: it did not answer in time.
    assert body == {"replicas": {live: 200, stuck: 504}}, body
    names = set(deployment.converged())  # the stuck one again, or the replica Ray Serve put in its place
    assert deployment.http("/health") == (200, {"replicas": dict.fromkeys(names, 200)})


def _long_prompt(deployment: Deployment, model: str, tokens: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy answer through ``model`` runs ``tokens`` long (no end token first), and
    that answer: long enough for the request to be caught in flight."""
    for i in range(50):
        want = deployment.peft(model, deployment.prompt(i), tokens)
        if len(want) == tokens:
            return deployment.prompt(i), want
    raise AssertionError(f"no prompt runs {tokens} tokens through {model}")


def _in_flight_on(deployment: Deployment) -> str | None:
    """The replica that reports a request in its queue, if any."""
    for name in deployment.names():
        try:
            if deployment.call(name, "report")["queue"] > 0:
                return name
        except Exception:  # a replica that has just gone: the other one is the one looked for
            continue
    return None


def test_a_request_in_flight_on_a_killed_replica_is_answered_by_another(deployment: Deployment) -> None:
    ids, want = _long_prompt(deployment, "pin0", 240)
    with ThreadPoolExecutor(1) as pool:
        for _ in range(3):
            deployment.converged()
            future = pool.submit(deployment.completion, "pin0", ids, len(want))
            victim = deployment.wait_for(
                "a replica with the request in flight", lambda: _in_flight_on(deployment), every=0.01
            )
            deployment.kill(victim)
            status, body, replica = future.result()
            if replica == victim:
                continue  # it was answered before the kill took the replica: catch the next one
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == want
            assert replica is not None and replica != victim
            break
        else:
            pytest.fail("three requests ended before their replica was killed")
    deployment.converged()


def test_a_stream_cut_by_a_killed_replica_ends_with_an_error_event(deployment: Deployment) -> None:
    ids, _ = _long_prompt(deployment, "pin0", 240)
    body = {"model": "pin0", "prompt": ids, "max_tokens": 240, "temperature": 0, "stream": True}
    for _ in range(3):
        deployment.converged()
        request = urllib.request.Request(
            deployment.url + "/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            victim = response.headers["x-lora-pin-replica"]
            first = response.readline()
            assert first.startswith(b"data: {"), first
            deployment.kill(victim)
            # The rest, to the end: the connection closes cleanly (no IncompleteRead).
            events = [line[6:] for line in response.read().splitlines() if line.startswith(b"data: ")]
        if events and events[-1] == b"[DONE]":
            continue  # it ended before the kill took the replica: catch the next one
        assert events, "the stream ended without a word"
        error = json.loads(events[-1])["error"]
        assert error["code"] == 503 and victim in error["message"], error
        break
    else:
        pytest.fail("three streams ended before their replica was killed")
    deployment.converged()
