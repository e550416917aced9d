"""The replicated server's routing and bookkeeping on fabricated replica stats: the ranker the Ray Serve
request router uses, the routing stats a replica reports, and how the ingress merges adapter changes
and the replicas' answers."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from lora_pin.model.lifecycle import AdapterPlacement, Placement
from lora_pin.routing import home_replicas
from lora_pin.serve.ray.ingress import combine
from lora_pin.serve.ray.merge import merge_health, merge_metrics, merge_models
from lora_pin.serve.ray.router import AffinityRanker, RouteHint, replica_stats

NAMES = ["r0", "r1", "r2", "r3"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stats(holding: dict[str, str] | None = None, free: int = 2) -> dict[str, Any]:
    return {"free_slots": free, "holding": holding or {}}


def _rows(**holding: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, _stats(holding.get(n))) for n in NAMES]


def test_device_beats_host_beats_home_beats_load() -> None:
    ranker = AffinityRanker(queue_bound=4)
    rows = _rows(r2={"a": "host"}, r3={"a": "device"})
    for _ in range(2):
        ranker.sent("r3")  # busier, yet holds the adapter in a slot
    order = ranker.rank(RouteHint(adapter="a"), rows)
    assert [NAMES[i] for i in order[:2]] == ["r3", "r2"]
    home = NAMES[home_replicas("b", NAMES, 1)[0]]
    assert NAMES[ranker.rank(RouteHint(adapter="b"), _rows())[0]] == home


def test_pinned_and_base_requests_go_by_load_alone() -> None:
    ranker = AffinityRanker(queue_bound=4)
    rows = _rows(r0={"p": "device"}, r1={"p": "device"}, r2={"p": "device"}, r3={"p": "device"})
    for name in ("r0", "r0", "r1", "r3"):
        ranker.sent(name)
    assert NAMES[ranker.rank(RouteHint(adapter="p", pinned=True), rows)[0]] == "r2"
    assert NAMES[ranker.rank(RouteHint(), rows)[0]] == "r2"
    # Pinned everywhere, so where it sits in a slot says nothing: a busy holder is not preferred.
    rows = _rows(r0={"p": "device"})
    assert NAMES[ranker.rank(RouteHint(adapter="p", pinned=True), rows)[0]] != "r0"


def test_a_replica_at_its_queue_bound_spills_and_takes_again_when_it_drains() -> None:
    ranker = AffinityRanker(queue_bound=2)
    rows = _rows(r1={"a": "device"})
    hint = RouteHint(adapter="a")
    ranker.sent("r1")
    assert NAMES[ranker.rank(hint, rows)[0]] == "r1"
    ranker.sent("r1")
    assert NAMES[ranker.rank(hint, rows)[0]] != "r1"
    assert NAMES[ranker.rank(hint, rows)[-1]] == "r1"
    ranker.completed("r1")
    assert NAMES[ranker.rank(hint, rows)[0]] == "r1"


def test_where_a_request_went_counts_as_fetching_until_the_memory_ends() -> None:
    clock = Clock()
    ranker = AffinityRanker(queue_bound=1, memory_s=3.0, clock=clock)
    hint = RouteHint(adapter="a")
    first = NAMES[ranker.rank(hint, _rows(), "q1")[0]]
    ranker.sent(first)
    # The first choice is full now: the next request spills and is remembered on its own replica.
    second = NAMES[ranker.rank(hint, _rows(), "q2")[0]]
    assert second != first
    ranker.sent(second)
    ranker.completed(first)
    ranker.completed(second)
    # Both replicas now count as fetching it; a third request stays on one of them, not elsewhere.
    assert NAMES[ranker.rank(hint, _rows(), "q3")[0]] in {first, second}
    clock.now += 10
    home = NAMES[home_replicas("a", NAMES, 1)[0]]
    assert NAMES[ranker.rank(hint, _rows(), "q4")[0]] == home


def test_popular_adapters_get_more_homes() -> None:
    ranker = AffinityRanker(window=100)
    rows = _rows()
    for i in range(100):
        ranker.rank(RouteHint(adapter="hot" if i % 2 else f"cold{i}"), rows, f"q{i}")
    assert ranker.homes("hot", 4) == 2
    assert ranker.homes("cold0", 4) == 1
    # Ranking the same request again (Ray Serve retries) does not count it twice.
    for _ in range(50):
        ranker.rank(RouteHint(adapter="hot"), rows, "q1")
    assert ranker.homes("hot", 4) == 2


def test_a_request_for_one_replica_goes_there_or_nowhere() -> None:
    ranker = AffinityRanker()
    assert ranker.rank(RouteHint(adapter="a", replica="r2"), _rows(r0={"a": "device"})) == [2]
    assert ranker.rank(RouteHint(replica="gone"), _rows()) == []


def test_adding_a_replica_moves_about_one_in_n_of_the_homes() -> None:
    ranker = AffinityRanker()
    adapters = [f"ad{i}" for i in range(2000)]
    before = {a: NAMES[ranker.rank(RouteHint(adapter=a), _rows())[0]] for a in adapters}
    grown = [*_rows(), ("r4", _stats())]
    after = {a: [n for n, _ in grown][ranker.rank(RouteHint(adapter=a), grown)[0]] for a in adapters}
    moved = [a for a in adapters if before[a] != after[a]]
    assert all(after[a] == "r4" for a in moved)
    assert 0.12 < len(moved) / len(adapters) < 0.28  # about 1/5


def test_an_adapters_requests_go_only_where_it_is_served_at_the_desired_version() -> None:
    ranker = AffinityRanker(queue_bound=4)
    rows = [
        ("r0", {**_stats({"a": "device"}), "serves": {"a": {"version": 1, "pinned": False}}}),
        ("r1", {**_stats(), "serves": {"a": {"version": 3, "pinned": False}}}),
        ("r2", {**_stats(), "serves": {}}),
        ("r3", _stats()),  # no report yet
    ]
    # r0 holds it in a slot, but at an older version: it is left out, the pinned flag or not.
    for pinned in (False, True):
        assert ranker.rank(RouteHint(adapter="a", pinned=pinned, version=3), rows) == [1]
    assert sorted(ranker.rank(RouteHint(adapter="a", version=1), rows)) == [0, 1]
    # Without a version (or for the base) every replica is ranked.
    assert sorted(ranker.rank(RouteHint(adapter="a"), rows)) == [0, 1, 2, 3]
    assert sorted(ranker.rank(RouteHint(), rows)) == [0, 1, 2, 3]
    # When no report has it yet (a report on its way), any replica may answer: the ingress sees it.
    assert sorted(ranker.rank(RouteHint(adapter="a", version=9), rows)) == [0, 1, 2, 3]


def test_a_retried_request_avoids_the_replicas_it_failed_on() -> None:
    ranker = AffinityRanker(queue_bound=4)
    rows = _rows(r1={"a": "device"})
    assert NAMES[ranker.rank(RouteHint(adapter="a"), rows)[0]] == "r1"
    order = ranker.rank(RouteHint(adapter="a", exclude=("r1", "r3")), rows)
    assert sorted(NAMES[i] for i in order) == ["r0", "r2"]
    assert ranker.rank(RouteHint(exclude=tuple(NAMES)), rows) == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="queue_bound"):
        AffinityRanker(queue_bound=0)


def _placement(*entries: tuple[str, str, bool, int], slots: int = 4) -> Placement:
    adapters = tuple(
        AdapterPlacement(
            name=n, id=n, digest="0" * 64, generation=1, tier=tier, slot=None, pinned=pinned,
            in_flight=in_flight, unloading=False, host_bytes=1,
        )
        for n, tier, pinned, in_flight in entries
    )  # fmt: skip
    device = sum(1 for a in adapters if a.tier == "device")
    return Placement(adapters, slots, slots - device, 0, 0, None)


def test_routing_stats_from_a_placement_snapshot() -> None:
    placement = _placement(
        ("pinned", "device", True, 0),
        ("busy", "device", False, 2),
        ("idle", "device", False, 0),
        ("warm", "host", False, 0),
        ("cold", "disk", False, 0),
        ("coming", "fetching", False, 1),
    )
    stats = replica_stats("r0", placement, queue=3)
    # Free: the empty slot and the one whose adapter nobody uses (a load there evicts no one waited on).
    assert stats == {
        "replica": "r0",
        "free_slots": 2,
        "queue": 3,
        "holding": {
            "pinned": "device",
            "busy": "device",
            "idle": "device",
            "warm": "host",
            "coming": "fetching",
        },
    }
    assert json.loads(json.dumps(stats)) == stats
    assert replica_stats("r1", None, 0)["holding"] == {}


def test_answers_that_agree_pass_through_and_disagreements_name_the_replicas() -> None:
    text = [("content-type", "text/plain; charset=utf-8")]
    same = combine({"r0": (200, text, b"Success"), "r1": (200, text, b"Success")})
    assert same.status_code == 200 and same.body == b"Success"
    refused = combine({"r0": (400, text, b"bad"), "r1": (400, text, b"bad")})
    assert refused.status_code == 400
    mixed = combine({"r0": (200, text, b"Success"), "r1": (400, text, b"no room")})
    body = json.loads(bytes(mixed.body))
    assert mixed.status_code == 502
    assert body["replicas"]["r1"] == {"status": 400, "body": "no room"}
    assert "succeeded on r0" in body["error"]["message"] and "r1 (400: no room)" in body["error"]["message"]


def _answer(status: int, body: Any, content_type: str = "application/json") -> tuple[int, list[Any], bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return status, [("content-type", content_type)], raw


def _cards(*models: tuple[str, str]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": m, "root": root, "object": "model"} for m, root in models]}


def test_models_are_the_union_and_a_disagreement_is_named() -> None:
    same = _cards(("tiny", "/m"), ("a", "/ad/a"))
    agreed = json.loads(merge_models({"r0": _answer(200, same), "r1": _answer(200, same)}).body)
    assert agreed == same
    differ = {
        "r0": _answer(200, _cards(("tiny", "/m"), ("a", "/ad/a"))),
        "r1": _answer(200, _cards(("tiny", "/m"), ("a", "/ad/a2"), ("b", "/ad/b"))),
        "r2": _answer(503, {"error": "down"}),
    }
    merged = json.loads(merge_models(differ).body)
    assert [c["id"] for c in merged["data"]] == ["tiny", "a", "b"]
    assert merged["lora_pin_disagreement"] == {
        "a": {"r0": "/ad/a", "r1": "/ad/a2"},
        "b": {"r0": None, "r1": "/ad/b"},
    }
    assert merge_models({"r0": _answer(503, {})}).status_code == 503
    assert merge_models({"r0": _answer(401, {"error": "Unauthorized"})}).status_code == 401


def test_health_is_green_while_one_replica_is() -> None:
    one_down = merge_health({"r0": _answer(200, b""), "r1": _answer(503, {"error": "down"})})
    assert one_down.status_code == 200
    assert json.loads(one_down.body) == {"replicas": {"r0": 200, "r1": 503}}
    all_down = merge_health({"r0": _answer(503, {}), "r1": _answer(503, {})})
    assert (
        all_down.status_code == 503 and "r0 (503), r1 (503)" in json.loads(all_down.body)["error"]["message"]
    )
    assert merge_health({}).status_code == 503
    assert merge_health({"r0": _answer(401, {}), "r1": _answer(401, {})}).status_code == 401


def test_metrics_label_every_sample_with_its_replica_and_keep_one_header_per_family() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def text(requests: int) -> bytes:
        return (
            "# HELP lora_pin_requests_total Requests.\n# TYPE lora_pin_requests_total counter\n"
            f'lora_pin_requests_total{{adapter="a"}} {requests}.0\n'
            "# HELP lora_pin_slots Slots.\n# TYPE lora_pin_slots gauge\nlora_pin_slots 4.0\n"
        ).encode()

    plain = "text/plain; version=0.0.4"
    merged = merge_metrics({"r0": _answer(200, text(3), plain), "r1": _answer(200, text(5), plain)})
    families = {f.name: f for f in text_string_to_metric_families(merged.body.decode())}
    samples = {
        (s.name, s.labels.get("replica"), s.labels.get("adapter")): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples == {
        ("lora_pin_requests_total", "r0", "a"): 3.0,
        ("lora_pin_requests_total", "r1", "a"): 5.0,
        ("lora_pin_slots", "r0", None): 4.0,
        ("lora_pin_slots", "r1", None): 4.0,
    }
    assert merged.body.decode().count("# TYPE lora_pin_slots gauge") == 1
