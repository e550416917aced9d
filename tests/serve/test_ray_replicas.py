"""``lora-pin serve --replicas``: two CPU replicas of the tiny model on a local Ray cluster behind one
ingress (``deployment`` in conftest.py), driven over HTTP with the official ``openai`` client: pinned
adapters sit on every replica, one adapter's requests stay on one replica until it spills, outputs equal
PEFT's token for token, and adapter changes over HTTP reach every replica and survive a restarted
ingress. test_ray_healing.py has the replicas that die, stall or drift."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

if TYPE_CHECKING:
    from conftest import Deployment


def test_pinned_adapters_are_resident_on_every_replica(deployment: Deployment) -> None:
    replicas = deployment.adapters()
    assert len(replicas) == 2
    for name, adapters in replicas.items():
        for pinned in deployment.PINNED:
            assert adapters[pinned]["pinned"], (name, adapters)
            assert adapters[pinned]["tier"] in ("device", "host"), (name, adapters)


def test_outputs_equal_peft_token_for_token(deployment: Deployment) -> None:
    for i, model in enumerate(["tiny", *deployment.ADAPTERS]):
        got, _ = deployment.complete(model, deployment.prompt(i))
        assert got == deployment.peft(model, deployment.prompt(i)), model


def test_one_adapters_requests_stay_on_one_replica_until_it_spills(deployment: Deployment) -> None:
    served_by = {deployment.complete("ad2", deployment.prompt(i))[1] for i in range(6)}
    assert len(served_by) == 1, served_by
    assert deployment.adapters()[served_by.pop()]["ad2"]["tier"] == "device"

    # The router must see every replica as it is now before ad3 is routed: a report older than the ad2
    # requests could show ad3 absent where a slot still holds it, and two replicas would then hold ad3.
    now = {name: int(report["at"]) for name, report in deployment.reports().items()}
    deployment.wait_for(
        "the router's reports as new as the replicas' after the ad2 requests",
        lambda: all(
            int((deployment.ingress("routing")[name]["report"] or {}).get("at", 0)) >= at
            for name, at in now.items()
        ),
    )
    _, holder = deployment.complete("ad3", deployment.prompt(0))
    other = next(n for n in deployment.names() if n != holder)
    deployment.wait_for(
        "the router sees ad3 in a slot of the replica that answered",
        lambda: (
            (deployment.ingress("routing")[holder]["report"] or {}).get("holding", {}).get("ad3") == "device"
        ),
    )
    seen_on_other = (deployment.ingress("routing")[other]["report"] or {}).get("holding", {}).get("ad3")
    assert seen_on_other != "device", "both replicas hold ad3: the router would share it by load"
    want = {i: deployment.peft("ad3", deployment.prompt(i)) for i in range(deployment.QUEUE_BOUND + 1)}
    # The holder frozen finishes nothing, so the router's count of its requests in flight stays where
    # the requests put it: the gate that holds its queue at the bound, whatever the machine's speed.
    with ThreadPoolExecutor(deployment.QUEUE_BOUND) as pool, deployment.frozen(holder):
        held = [
            pool.submit(deployment.complete, "ad3", deployment.prompt(i))
            for i in range(deployment.QUEUE_BOUND)
        ]
        deployment.wait_for(
            f"the router counts {deployment.QUEUE_BOUND} requests in flight on the ad3 holder",
            lambda: deployment.ingress("routing")[holder]["in_flight"] == deployment.QUEUE_BOUND,
        )
        # At the bound the holder goes behind the other replica: the next request spills there, and
        # is answered while the holder still holds the first ones.
        tokens, spilled_to = deployment.complete("ad3", deployment.prompt(deployment.QUEUE_BOUND))
        assert spilled_to == other
        assert tokens == want[deployment.QUEUE_BOUND]
        assert not any(f.done() for f in held)
    for i, future in enumerate(held):
        assert future.result() == (want[i], holder)


def test_adapter_changes_over_http_reach_every_replica(deployment: Deployment) -> None:
    late = str(deployment.dirs["late"])
    if "late" not in deployment.desired()["adapters"]:
        status, body = deployment.http(
            "/v1/load_lora_adapter", "POST", {"lora_name": "late", "lora_path": late}
        )
        assert status == 200, body
    assert all("late" in adapters for adapters in deployment.adapters().values())
    status, body = deployment.http("/v1/pin_lora_adapter", "POST", {"lora_name": "late"})
    assert status in (200, 400), body  # 400: two pins already (pin0 and pin1)
    if status == 400:
        assert deployment.http("/v1/unpin_lora_adapter", "POST", {"lora_name": "pin1"})[0] == 200
        status, body = deployment.http("/v1/pin_lora_adapter", "POST", {"lora_name": "late"})
        assert status == 200, body
    assert all(adapters["late"]["pinned"] for adapters in deployment.adapters().values())
    # Refused on every replica alike: the replicas' own answer, and nothing changes anywhere.
    before = deployment.desired()
    status, body = deployment.http(
        "/v1/load_lora_adapter", "POST", {"lora_name": "x", "lora_path": "/nowhere"}
    )
    assert status == 400, body
    assert not any("x" in adapters for adapters in deployment.adapters().values())
    assert deployment.desired() == before
    status, body = deployment.http("/v1/models")
    assert status == 200 and "late" in {m["id"] for m in body["data"]}, body
    got, _ = deployment.complete("late", deployment.prompt(3))
    assert got == deployment.peft("late", deployment.prompt(3))


def _ingress_id() -> str | None:
    import ray

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#LoRAIngress#" in a["name"]]
    return str(actors[0]["name"]) if len(actors) == 1 else None


def test_a_restarted_ingress_keeps_the_adapters_loaded_over_http(deployment: Deployment) -> None:
    import ray

    late = str(deployment.dirs["late"])
    if "late" not in deployment.desired()["adapters"]:
        status, _ = deployment.http("/v1/load_lora_adapter", "POST", {"lora_name": "late", "lora_path": late})
        assert status == 200
    before = deployment.desired()
    old = _ingress_id()
    assert old is not None
    ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
    deployment.wait_for(
        "a new ingress answers /health",
        lambda: _ingress_id() not in (None, old) and deployment.http("/health")[0] == 200,
    )
    # The new ingress started with the start-up adapters only; it adopts the replicas' newer ones.
    after = deployment.desired()

    def summary(desired: dict[str, Any]) -> tuple[int, dict[str, tuple[str, bool, int]]]:
        adapters = desired["adapters"]
        return desired["generation"], {
            n: (os.path.realpath(a["path"]), a["pinned"], a["version"]) for n, a in adapters.items()
        }

    assert summary(after) == summary(before), (before, after)
    # And a replica started after it gets them.
    victim = deployment.names()[0]
    deployment.kill(victim)
    deployment.wait_for(f"a replica in place of {victim}", lambda: victim not in deployment.names())
    reports = deployment.converged()
    assert victim not in reports
    for name, report in reports.items():
        assert "late" in report["serves"], (name, report)


def test_models_health_and_metrics_cover_every_replica(deployment: Deployment) -> None:
    names = set(deployment.converged())
    status, body = deployment.http("/v1/models")
    assert status == 200 and "lora_pin_disagreement" not in body, body
    assert {"tiny", *deployment.PINNED} <= {
        m["id"] for m in body["data"]
    }  # earlier tests load and unload others
    status, body = deployment.http("/health")
    assert status == 200 and body == {"replicas": dict.fromkeys(names, 200)}, body
    status, text = deployment.http("/metrics")
    assert status == 200
    labelled = {name for name in names if f'replica="{name}"' in text}
    assert labelled == names, text[:2000]


def test_requests_for_every_adapter_from_many_clients_at_once(deployment: Deployment) -> None:
    models = ["tiny", *sorted(deployment.desired()["adapters"])]
    want = {(m, i): deployment.peft(m, deployment.prompt(i)) for m in models for i in range(2)}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(key: tuple[str, int]) -> None:
        try:
            assert deployment.complete(key[0], deployment.prompt(key[1]))[0] == want[key], key
        except BaseException as e:  # reported below, with every other failure
            with lock:
                errors.append(e)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, list(want)))
    assert not errors, errors
