"""Parsing 10,000 mixed ``--lora-paths`` items from Python: lora_pin's Rust parser vs a plain-Python parser
with the same rules (json + a dataclass), written here for the comparison. Prints both times and the ratio.

    .venv/bin/python benches/spec_parse.py [--items 10000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from lora_pin import parse_lora_paths

SGLANG_KEYS = {"lora_name", "lora_path", "pinned"}
VLLM_KEYS = {"name", "path", "base_model_name", "pinned"}


@dataclass(frozen=True)
class PlainRef:
    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool
    base_model_name: str | None


def _check(name: str, path: str, index: int) -> tuple[str, str]:
    name, path = name.strip(), path.strip()
    if not name or "=" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"item {index}: bad name {name!r}")
    if not path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ValueError(f"item {index}: bad path {path!r}")
    return name, path


def _ref(name: str, path: str, pinned: bool, base: str | None) -> PlainRef:
    return PlainRef(uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex, name, path, pinned, base)


def plain_parse(items: list[str]) -> list[PlainRef]:
    """The same rules as lora_pin's parser (minus @FILE), in the style of the peers' Python parsers."""
    refs: list[PlainRef] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(items):
        item = raw.strip()
        if not item:
            raise ValueError(f"item {index}: empty")
        if item.startswith("{"):
            obj = json.loads(item)
            if not isinstance(obj, dict):
                raise ValueError(f"item {index}: not an object")
            unknown = set(obj) - SGLANG_KEYS - VLLM_KEYS
            if unknown:
                raise ValueError(f"item {index}: unknown keys {sorted(unknown)}")
            vllm = "name" in obj or "path" in obj or "base_model_name" in obj
            if vllm and ("lora_name" in obj or "lora_path" in obj):
                raise ValueError(f"item {index}: mixes schemas")
            name, path = (
                (obj.get("name"), obj.get("path")) if vllm else (obj.get("lora_name"), obj.get("lora_path"))
            )
            pinned = obj.get("pinned", False)
            base = obj.get("base_model_name")
            if not isinstance(name, str) or not isinstance(path, str) or not isinstance(pinned, bool):
                raise ValueError(f"item {index}: wrong types")
            if base is not None and not isinstance(base, str):
                raise ValueError(f"item {index}: wrong base_model_name")
            name, path = _check(name, path, index)
            ref = _ref(name, path, pinned, base)
        elif "=" in item:
            name, path = item.split("=", 1)
            name, path = _check(name, path, index)
            ref = _ref(name, path, False, None)
        else:
            name, path = _check(item, item, index)
            ref = _ref(name, path, False, None)
        if ref.lora_name in seen:
            raise ValueError(f"duplicate name {ref.lora_name!r}: items {seen[ref.lora_name]} and {index}")
        seen[ref.lora_name] = index
        refs.append(ref)
    return refs


def mixed_items(n: int) -> list[str]:
    """The same mix as the criterion bench (benches/spec.rs)."""
    out = []
    for i in range(n):
        k = i % 4
        if k == 0:
            out.append(f"/srv/adapters/bare-{i}")
        elif k == 1:
            out.append(f"name-{i}=/srv/adapters/named-{i}")
        elif k == 2:
            pinned = "true" if i % 40 == 2 else "false"
            out.append(f'{{"lora_name": "sg-{i}", "lora_path": "/srv/adapters/sg-{i}", "pinned": {pinned}}}')
        else:
            out.append(f'{{"name": "vl-{i}", "path": "/srv/adapters/vl-{i}", "base_model_name": "llama"}}')
    return out


def best_of(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--items", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    items = mixed_items(args.items)
    ours = parse_lora_paths(items)
    theirs = plain_parse(items)
    assert [(r.lora_id, r.lora_name, r.lora_path, r.pinned) for r in ours] == [
        (r.lora_id, r.lora_name, r.lora_path, r.pinned) for r in theirs
    ], "the two parsers disagree"
    rust_best, rust_med = best_of(lambda: parse_lora_paths(items), args.repeat)
    py_best, py_med = best_of(lambda: plain_parse(items), args.repeat)
    print(f"{args.items} mixed items, best of {args.repeat} (median in brackets)")
    print(f"  lora_pin.parse_lora_paths (Rust): {rust_best * 1e3:8.2f} ms  ({rust_med * 1e3:.2f} ms)")
    print(f"  plain-Python parser (baseline):   {py_best * 1e3:8.2f} ms  ({py_med * 1e3:.2f} ms)")
    print(f"  speed-up: {py_best / rust_best:.1f}x best, {py_med / rust_med:.1f}x median")


if __name__ == "__main__":
    main()
