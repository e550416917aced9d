"""The replicated server's desired adapters as plain data: how adapter changes update them, how a
replica's state differs from them, and the order of the steps that bring a replica there."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

pytest.importorskip("ray.serve")  # the package the module lives in needs the ray extra

from lora_pin.args import add_lora_args, lora_config_from_args
from lora_pin.serve.ray.desired import (
    Step,
    apply_change,
    differences,
    plan,
    serves_at,
    startup_adapters,
    startup_items,
)


def _want(path: str, pinned: bool = False, version: int = 0) -> dict[str, Any]:
    return {"path": path, "pinned": pinned, "version": version}


def test_adapter_changes_update_the_desired_adapters_and_their_versions() -> None:
    desired = {"a": _want("/x/a", pinned=True)}
    loaded = apply_change(desired, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/x/b"}, 4)
    assert loaded["b"] == _want("/x/b", version=4)
    assert desired == {"a": _want("/x/a", pinned=True)}
    sglang = apply_change(
        loaded, "/load_lora_adapter", {"lora_name": "c", "lora_path": "/x/c", "pinned": True}, 5
    )
    assert sglang["c"] == _want("/x/c", pinned=True, version=5)
    inplace = apply_change(
        desired, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/y/a", "load_inplace": True}, 6
    )
    assert inplace["a"] == _want("/y/a", pinned=True, version=6)
    unpinned = apply_change(loaded, "/v1/unpin_lora_adapter", {"lora_name": "a"}, 7)
    assert unpinned["a"] == _want("/x/a", version=0)  # a pin leaves the weights' version alone
    assert "a" not in apply_change(loaded, "/unload_lora_adapter", {"lora_name": "a"}, 8)


def test_a_replica_is_converged_when_names_pins_and_versions_match() -> None:
    desired = {"a": _want("/x/a", pinned=True, version=2), "b": _want("/x/b", version=0)}
    serves = {"a": {"pinned": True, "version": 2}, "b": {"pinned": False, "version": 0}}
    assert differences(serves, desired) == []
    assert differences({**serves, "a": {"pinned": True, "version": 5}}, desired) == []  # newer is fine
    assert differences({**serves, "c": {"pinned": False, "version": 1}}, desired) == [
        "c: served, not desired"
    ]
    assert differences({"a": serves["a"]}, desired) == ["b: desired, not served"]
    assert differences({**serves, "a": {"pinned": True, "version": 1}}, desired) == [
        "a: served at version 1, desired 2"
    ]
    assert differences({**serves, "b": {"pinned": True, "version": 0}}, desired) == [
        "b: pinned, desired otherwise"
    ]
    assert serves_at(serves, "a", 2) and not serves_at(serves, "a", 3) and not serves_at(serves, "z", 0)


def test_the_plan_unpins_before_it_pins_and_loads_before_it_pins() -> None:
    # The user's case: start-up pins p0 and p1 fill the pinnable slots; at run time p1 was unpinned and
    # "late" loaded pinned, "gone" unloaded, "moved" replaced from another path, "same" replaced in place.
    serves = {
        "p0": _want("/s/p0", pinned=True),
        "p1": _want("/s/p1", pinned=True),
        "gone": _want("/s/gone"),
        "moved": _want("/s/moved"),
        "same": _want("/s/same"),
    }
    desired = {
        "p0": _want("/s/p0", pinned=True),
        "p1": _want("/s/p1"),
        "late": _want("/r/late", pinned=True, version=3),
        "moved": _want("/r/moved", version=4),
        "same": _want("/s/same", version=5),
    }
    steps = plan(serves, desired)
    assert steps == [
        Step("unload", "gone"),
        Step("unpin", "p1"),
        Step("replace", "moved", "/r/moved", 4),
        Step("replace", "same", "/s/same", 5),
        Step("load", "late", "/r/late", 3),
        Step("pin", "late"),
    ]
    # Applied in order, the pins never exceed what the desired adapters pin.
    pins = {n for n, s in serves.items() if s["pinned"]}
    peak = len(pins)
    for step in steps:
        if step.action == "unpin":
            pins.discard(step.name)
        elif step.action == "pin":
            pins.add(step.name)
        peak = max(peak, len(pins))
    assert peak == max(2, sum(w["pinned"] for w in desired.values()))
    assert plan(desired, desired) == []


def test_a_load_from_a_symlinked_path_is_the_same_path(tmp_path: Any) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    serves = {"a": _want(str(tmp_path / "link"), version=1)}
    assert plan(serves, {"a": _want(str(tmp_path / "real"), version=1)}) == []


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_lora_args(parser)
    return parser.parse_args(list(flags))


def test_start_up_items_take_the_desired_pins() -> None:
    items = [
        json.dumps({"lora_name": "p0", "lora_path": "/s/p0", "pinned": True}),
        json.dumps({"lora_name": "p1", "lora_path": "/s/p1", "pinned": True}),
        "plain=/s/plain",
    ]
    args = _args("--lora-paths", *items, "--max-loras-per-batch", "3")
    assert startup_adapters(args) == {
        "p0": _want("/s/p0", pinned=True),
        "p1": _want("/s/p1", pinned=True),
        "plain": _want("/s/plain"),
    }
    desired = {"p0": _want("/s/p0", pinned=True), "plain": _want("/s/plain", pinned=True)}
    args.lora_paths = startup_items(args, desired)
    refs = {r.lora_name: r for r in lora_config_from_args(args).refs}  # type: ignore[union-attr]
    # p1 was unpinned (and unloaded) since: it starts unpinned, and the plan unloads it next.
    assert {n: (r.lora_path, r.pinned) for n, r in refs.items()} == {
        "p0": ("/s/p0", True),
        "p1": ("/s/p1", False),
        "plain": ("/s/plain", True),
    }
    assert startup_items(_args("--max-lora-rank", "8", "--lora-target-modules", "all"), desired) is None


@pytest.mark.parametrize("path", ["/v1/pin_lora_adapter", "/v1/unpin_lora_adapter"])
def test_a_pin_of_an_unknown_adapter_changes_nothing(path: str) -> None:
    desired = {"a": _want("/x/a")}
    assert apply_change(desired, path, {"lora_name": "zz"}, 3) == desired
