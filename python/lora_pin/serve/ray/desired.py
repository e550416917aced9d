"""The deployment's desired adapters, and how a replica reaches them, as plain data (no Ray here).

The ingress keeps the *desired adapters*: name -> ``{"path": str, "pinned": bool, "version": int}``, where
``version`` is the generation of the change that last loaded the adapter's weights (0: at start-up).
Every adapter change that succeeds over HTTP bumps the generation (:func:`apply_change`). A replica
reports what it *serves* in the same shape (the ``version`` it loaded each adapter at), and:

- :func:`differences` says how it differs from the desired adapters (none: converged);
- :func:`plan` orders the steps that bring it there: unloads, then unpins, then in-place replacements
  and loads (unpinned), then pins, so a pin never waits on one that is going away and a load never
  needs a slot the pins still hold;
- :func:`serves_at` says whether it may take an adapter's requests: it serves the adapter at the
  desired version or newer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lora_pin.args import lora_config_from_args

__all__ = [
    "ADAPTER_PATHS",
    "LOADS",
    "Step",
    "apply_change",
    "differences",
    "plan",
    "serves_at",
    "startup_adapters",
    "startup_items",
]

# The adapter endpoints, by path: what a success means for the desired adapters.
LOADS = frozenset({"/v1/load_lora_adapter", "/load_lora_adapter"})
UNLOADS = frozenset({"/v1/unload_lora_adapter", "/unload_lora_adapter"})
PINS = {"/v1/pin_lora_adapter": True, "/v1/unpin_lora_adapter": False}
ADAPTER_PATHS = LOADS | UNLOADS | frozenset(PINS)

Adapters = dict[str, dict[str, Any]]
"""name -> ``{"path": str, "pinned": bool, "version": int}``."""


def startup_adapters(args: Any) -> Adapters:
    """The adapters the ``lora-pin serve`` arguments ``args`` load at start-up, at version 0.

    Raises:
        SpecError: as :func:`lora_pin.args.lora_config_from_args`.
    """
    config = lora_config_from_args(args)
    refs = () if config is None else config.refs
    return {r.lora_name: {"path": r.lora_path, "pinned": bool(r.pinned), "version": 0} for r in refs}


def startup_items(args: Any, desired: Mapping[str, Mapping[str, Any]]) -> list[str] | None:
    """``args``' ``--lora-paths`` items with the desired pins applied (one JSON item per start-up
    adapter, pinned only when ``desired`` pins it), for a replica that starts after runtime changes:
    it then never pins a start-up adapter that was unpinned since, and so never lacks the room for a pin
    made at run time. None when ``args`` has no start-up adapters. Start-up adapters that are no longer
    desired stay in (unpinned): they may be what the maximum rank and target modules are inferred from;
    :func:`plan` unloads them next.

    Raises:
        SpecError: as :func:`lora_pin.args.lora_config_from_args`.
    """
    config = lora_config_from_args(args)
    if config is None or not config.refs:
        return None
    return [
        json.dumps(
            {
                "lora_name": r.lora_name,
                "lora_path": r.lora_path,
                "pinned": bool(desired.get(r.lora_name, {}).get("pinned", False)),
            }
        )
        for r in config.refs
    ]


def apply_change(desired: Adapters, path: str, body: Mapping[str, Any], generation: int) -> Adapters:
    """``desired`` after the adapter endpoint ``path`` succeeded with request ``body`` as change
    ``generation`` (a new dict; ``desired`` is left as it was)."""
    changed = {name: dict(want) for name, want in desired.items()}
    name = str(body.get("lora_name"))
    if path in LOADS:
        inplace = path.startswith("/v1/") and bool(body.get("load_inplace")) and name in changed
        pinned = changed[name]["pinned"] if inplace else bool(body.get("pinned", False))
        changed[name] = {"path": str(body.get("lora_path")), "pinned": pinned, "version": generation}
    elif path in UNLOADS:
        changed.pop(name, None)
    elif path in PINS and name in changed:
        changed[name]["pinned"] = PINS[path]
    return changed


def serves_at(serves: Mapping[str, Mapping[str, Any]], adapter: str, version: int) -> bool:
    """Whether a replica serving ``serves`` (name -> ``{"version", ...}``) serves ``adapter`` at
    ``version`` or newer."""
    held = serves.get(adapter)
    return held is not None and int(held.get("version", -1)) >= version


def differences(
    serves: Mapping[str, Mapping[str, Any]], desired: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """How a replica serving ``serves`` differs from ``desired`` (both name -> ``{"pinned", "version",
    ...}``), one short line per adapter, sorted; empty when it has converged."""
    lines = []
    for name in sorted(set(serves) | set(desired)):
        have, want = serves.get(name), desired.get(name)
        if want is None:
            lines.append(f"{name}: served, not desired")
        elif have is None:
            lines.append(f"{name}: desired, not served")
        elif int(have.get("version", -1)) < int(want["version"]):
            lines.append(f"{name}: served at version {have.get('version')}, desired {want['version']}")
        elif bool(have.get("pinned")) != bool(want["pinned"]):
            lines.append(f"{name}: {'pinned' if have.get('pinned') else 'unpinned'}, desired otherwise")
    return lines


@dataclass(frozen=True)
class Step:
    """One step of :func:`plan`: ``action`` on adapter ``name`` (``path``: where a load reads it from;
    ``version``: the version it then serves)."""

    action: Literal["unload", "unpin", "replace", "load", "pin"]
    name: str
    path: str = ""
    version: int = 0


def plan(serves: Mapping[str, Mapping[str, Any]], desired: Mapping[str, Mapping[str, Any]]) -> list[Step]:
    """The steps that bring a replica serving ``serves`` (name -> ``{"path", "pinned", "version"}``) to
    ``desired`` (the same shape), in the order that needs no room twice: unloads, unpins, in-place
    replacements (the path differs or the version is older; the pin stays), loads (unpinned), pins.
    Each group is sorted by name."""
    gone = sorted(set(serves) - set(desired))
    steps = [Step("unload", n) for n in gone]
    kept = {n: serves[n] for n in serves if n in desired}
    steps += [Step("unpin", n) for n in sorted(kept) if kept[n].get("pinned") and not desired[n]["pinned"]]
    for name in sorted(kept):
        have, want = kept[name], desired[name]
        same_path = _same_path(str(have.get("path", "")), str(want["path"]))
        if not same_path or int(have.get("version", -1)) < int(want["version"]):
            steps.append(Step("replace", name, str(want["path"]), int(want["version"])))
    steps += [
        Step("load", n, str(desired[n]["path"]), int(desired[n]["version"]))
        for n in sorted(set(desired) - set(serves))
    ]
    steps += [
        Step("pin", n)
        for n in sorted(desired)
        if desired[n]["pinned"] and not (n in kept and kept[n].get("pinned"))
    ]
    return steps


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
