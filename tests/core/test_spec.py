"""The adapter-spec parser from Python: every accepted form, every error, argparse and the CLI."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import subprocess
import sys
import uuid
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lora_pin
from lora_pin import LoraPinError, LoRARef, SpecError, parse_lora_paths


def expected_id(name: str, path: str) -> str:
    """The id computed independently with Python's uuid module."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


def test_every_accepted_form() -> None:
    refs = parse_lora_paths(
        [
            " /srv/a ",
            "b=/srv/b=c",
            '{"lora_name": "c", "lora_path": "/srv/c", "pinned": true}',
            '{"name": "d", "path": "/srv/d", "base_model_name": "llama"}',
            {"lora_name": "e", "lora_path": "/srv/e"},
            {"name": "f", "path": pathlib.Path("/srv/f"), "pinned": True},
        ]
    )
    got = [(r.lora_name, r.lora_path, r.pinned, r.base_model_name) for r in refs]
    assert got == [
        ("/srv/a", "/srv/a", False, None),
        ("b", "/srv/b=c", False, None),
        ("c", "/srv/c", True, None),
        ("d", "/srv/d", False, "llama"),
        ("e", "/srv/e", False, None),
        ("f", "/srv/f", True, None),
    ]
    for r in refs:
        assert r.lora_id == expected_id(r.lora_name, r.lora_path)


def test_none_dict_and_at_file(tmp_path: pathlib.Path) -> None:
    assert parse_lora_paths(None) == []
    assert [r.lora_name for r in parse_lora_paths({"x": "/x", "y": "/y"})] == ["x", "y"]
    listing = tmp_path / "adapters.json"
    listing.write_bytes(orjson.dumps(["a=/a", {"lora_name": "b", "lora_path": "/b", "pinned": True}]))
    refs = parse_lora_paths(["z=/z", f"@{listing}"])
    assert [(r.lora_name, r.pinned) for r in refs] == [("z", False), ("a", False), ("b", True)]


def test_ref_value_semantics() -> None:
    a = LoRARef("m", "/p")
    b = parse_lora_paths(["m=/p"])[0]
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.to_dict() == {
        "lora_id": expected_id("m", "/p"),
        "lora_name": "m",
        "lora_path": "/p",
        "pinned": False,
    }
    assert 'lora_name="m"' in repr(a) and "pinned=False" in repr(a)
    fresh = LoRARef.new("m", "/p")
    assert fresh != a and fresh.lora_id != LoRARef.new("m", "/p").lora_id
    with pytest.raises(AttributeError):
        a.pinned = True  # type: ignore[misc]
    assert LoRARef("m", "/p", pinned=True, base_model_name="llama").to_dict()["base_model_name"] == "llama"
    with pytest.raises(SpecError, match="contains '='"):
        LoRARef("a=b", "/p")
    # A ref passed in keeps its own id (random or chosen) and pin.
    mine = LoRARef("k", "/p", lora_id="my-id", pinned=True)
    assert parse_lora_paths([fresh, mine, "n=/q"])[:2] == [fresh, mine]


ERROR_CASES = [
    (["ok=/a", "  "], r"item 1 \(\"  \"\): the item is empty"),
    (["=/a"], r"item 0 .*name is empty"),
    (["a="], r"item 0 .*path is empty"),
    (['{"lora_name": "a"'], r"item 0 .*malformed JSON.*line 1 column"),
    (['{"lora_name": "a", "lora_path": "/a", "extra": 1}'], r"item 0 .*unknown key \"extra\".*allowed keys"),
    (['{"lora_name": "a", "lora_path": "/a", "pinned": "false"}'], r"item 0 .*JSON boolean"),
    (['{"lora_name": "a"}'], r"item 0 .*missing key \"lora_path\""),
    (['{"lora_name": "a", "path": "/a"}'], r"item 0 .*mixes"),
    (["a\tb=/x"], r"item 0 .*control character"),
    ([{"lora_name": "a", "lora_path": "/a", "pinned": 1}], r"item 0 .*JSON boolean"),
    ([{"lora_name": "a", "lora_path": "/a", "pinned": [1]}], r"item 0 .*has type list"),
    ([{1: "a"}], r"item 0 .*keys must be strings"),
    ([{"name": "a", "path": "/a", "base_model_name": float("nan")}], r"item 0 .*\"base_model_name\" \(nan\)"),
    ([{"lora_name": "a", "lora_path": "/a", "pinned": 2**70}], r"item 0 .*JSON boolean.*1\.18"),
    (['{"lora_name": "a", "lora_path": "/a", "lora_name": "b"}'], r"item 0 .*\"lora_name\" appears twice"),
    ([42], r"item 0 \(42\): expected a string or a dict, got int"),
    (["a=/x", "b=/y", "a=/z"], r"duplicate adapter name \"a\": item 0 .* and item 2"),
    ("a=/x", r"single string"),
    (7, r"got int"),
    ({"a": 3}, r"item 0 .*string keys and values"),
]


@pytest.mark.parametrize(("values", "pattern"), ERROR_CASES)
def test_errors_name_the_item(values: object, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern) as info:
        parse_lora_paths(values)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and isinstance(info.value, LoraPinError)


def test_same_path_two_names_is_allowed() -> None:
    assert len(parse_lora_paths(["a=/same", "b=/same"])) == 2


def test_limit_cross_checks() -> None:
    pinned = [f'{{"lora_name": "p{i}", "lora_path": "/p{i}", "pinned": true}}' for i in range(3)]
    with pytest.raises(SpecError, match=r"3 adapters are pinned but max_loras_per_batch=3 allows at most 2"):
        parse_lora_paths(pinned, max_loras_per_batch=3)
    assert len(parse_lora_paths(pinned, max_loras_per_batch=4)) == 3
    with pytest.raises(SpecError, match=r"at least 1 \(got 0\)"):
        parse_lora_paths([], max_loras_per_batch=0)
    with pytest.raises(SpecError, match=r"at least 1 \(got -2\)"):
        parse_lora_paths([], max_loras_per_batch=-2)
    with pytest.raises(SpecError, match=r"max_loaded_loras=2 must be >= max_loras_per_batch=4"):
        parse_lora_paths([], max_loras_per_batch=4, max_loaded_loras=2)
    with pytest.raises(SpecError, match=r"3 adapters were given but max_loaded_loras=2"):
        parse_lora_paths(["a=/a", "b=/b", "c=/c"], max_loaded_loras=2)


def _parser() -> argparse.ArgumentParser:
    return lora_pin.add_lora_args(argparse.ArgumentParser(prog="server"))


def test_server_args_defaults_and_config() -> None:
    ns = _parser().parse_args(["--lora-paths", "a=/a", '{"lora_name":"b","lora_path":"/b","pinned":true}'])
    cfg = lora_pin.lora_config_from_args(ns)
    assert cfg.max_loras_per_batch == 8 and cfg.eviction_policy == "lru" and cfg.max_loaded_loras is None
    assert [r.lora_name for r in cfg.refs] == ["a", "b"] and [r.lora_name for r in cfg.pinned] == ["b"]
    ns = _parser().parse_args(
        [
            "--max-lora-rank",
            "16",
            "--lora-target-modules",
            "q_proj",
            "v_proj",
            "--lora-eviction-policy",
            "fifo",
        ]
    )
    cfg = lora_pin.lora_config_from_args(ns)
    assert cfg.refs == () and cfg.max_lora_rank == 16 and cfg.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--enable-lora"], r"both --max-lora-rank and --lora-target-modules are required"),
        (["--max-lora-rank", "8"], r"are required .*--max-lora-rank=8, --lora-target-modules=None"),
        (["--lora-paths", "a=/a", "--lora-target-modules", "all", "q_proj"], r"'all' must stand alone"),
        (["--lora-paths", "a=/a", "--max-lora-rank", "0"], r"at least 1 \(got 0\)"),
        (
            ["--lora-paths", "a=/a", "--max-loras-per-batch", "4", "--max-loaded-loras", "2"],
            r"max_loaded_loras=2",
        ),
        (["--lora-paths", "a=/a", "a=/b"], r"duplicate adapter name"),
        (
            ["--lora-paths", "a=/a", "--max-loras-per-batch", "100000"],
            r"must be in 1\.\.65536 \(got 100000\)",
        ),
        (["--lora-paths", "a=/a", "--max-loras-per-batch", "9" * 21], r"--max-loras-per-batch must be in"),
        (["--lora-paths", "a=/a", "--max-loaded-loras", "9" * 21], r"--max-loaded-loras must be in"),
    ],
)
def test_server_args_errors(argv: list[str], pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        lora_pin.lora_config_from_args(_parser().parse_args(argv))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lora_pin.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_cli_parse_prints_json() -> None:
    out = _cli("parse", "--max-loras-per-batch", "2", "--lora-paths", "a=/a", "/b")
    assert out.returncode == 0, out.stderr
    rows = orjson.loads(out.stdout)
    assert rows == [
        {
            "lora_id": expected_id("a", "/a"),
            "lora_name": "a",
            "lora_path": "/a",
            "pinned": False,
            "base_model_name": None,
        },
        {
            "lora_id": expected_id("/b", "/b"),
            "lora_name": "/b",
            "lora_path": "/b",
            "pinned": False,
            "base_model_name": None,
        },
    ]


def test_cli_parse_applies_a_servers_defaults_and_prints_base_model_name() -> None:
    """A server has 8 slots by default, so it refuses 8 pinned adapters: so does ``parse`` with no flag."""
    pinned = [f'{{"lora_name": "p{i}", "lora_path": "/p{i}", "pinned": true}}' for i in range(8)]
    out = _cli("parse", "--lora-paths", *pinned)
    assert out.returncode == 2 and "max_loras_per_batch=8" in out.stderr, out.stderr
    out = _cli("parse", "--lora-paths", '{"name": "v", "path": "/v", "base_model_name": "llama-3"}')
    assert out.returncode == 0, out.stderr
    assert orjson.loads(out.stdout)[0]["base_model_name"] == "llama-3"


def test_cli_parse_error_is_one_line_and_exit_2() -> None:
    out = _cli("parse", "--lora-paths", "a=/a", '{"lora_name": "b"')
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "item 1" in lines[0] and "malformed JSON" in lines[0]


names = st.text(
    st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="="), min_size=1
).filter(lambda s: s.strip() == s and s != "")
paths = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1).filter(
    lambda s: s.strip() == s and s
)


@settings(max_examples=300, deadline=None)
@given(name=names, path=paths, pinned=st.booleans(), base=st.none() | st.text(max_size=8))
def test_format_round_trips(name: str, path: str, pinned: bool, base: str | None) -> None:
    ref = LoRARef(name, path, pinned=pinned, base_model_name=base)
    assert parse_lora_paths([ref.to_spec()]) == [ref]
    assert parse_lora_paths([ref]) == [ref]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.text(max_size=40) | st.dictionaries(st.text(max_size=12), st.none() | st.booleans() | st.text())
    )
)
def test_arbitrary_input_only_raises_spec_errors(values: list[object]) -> None:
    with contextlib.suppress(SpecError):
        parse_lora_paths(values)  # type: ignore[arg-type]


# ---- input that used to escape as a non-LoraPinError (issue 14, items 8, 9 and 13) ----------------------

LONE = "\ud800"  # json.loads('"\\ud800"') returns this: valid JSON, no UTF-8 encoding
_SURROGATE_CALLS = {
    "LoRARef name": (lambda: LoRARef(f"a{LONE}", "/p"), "lora_name"),
    "LoRARef path": (lambda: LoRARef("a", f"/p{LONE}"), "lora_path"),
    "LoRARef base model": (lambda: LoRARef("a", "/p", base_model_name=LONE), "base_model_name"),
    "LoRARef id": (lambda: LoRARef("a", "/p", lora_id=LONE), "lora_id"),
    "LoRARef.new": (lambda: LoRARef.new(LONE, "/p"), "lora_name"),
    "text item": (lambda: parse_lora_paths([f"a={LONE}"]), "item 0"),
    "dict item value": (lambda: parse_lora_paths([{"lora_name": LONE, "lora_path": "/p"}]), "item 0"),
    "dict item key": (lambda: parse_lora_paths([{LONE: "x"}]), "item 0"),
    "name: path dict": (lambda: parse_lora_paths({"a": LONE}), "item 0"),
    "registry pin": (lambda: lora_pin.LoRARegistry(2).pin(LONE), "adapter name"),
    "registry unload": (lambda: lora_pin.LoRARegistry(2).unload(LONE), "adapter name"),
    "registry lookup": (lambda: LONE in lora_pin.LoRARegistry(2), "adapter name"),
}


@pytest.mark.parametrize("case", sorted(_SURROGATE_CALLS))
def test_a_lone_surrogate_is_a_spec_error(case: str) -> None:
    call, argument = _SURROGATE_CALLS[case]
    with pytest.raises(SpecError, match=rf"{argument}.*not valid text: it holds a lone surrogate"):
        call()


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: parse_lora_paths([], max_loras_per_batch=2**70), "max_loras_per_batch"),
        (lambda: parse_lora_paths([], max_loaded_loras=2**70), "max_loaded_loras"),
        (lambda: lora_pin.LoRARegistry(2**70), "max_loras_per_batch"),
        (lambda: lora_pin.LoRARegistry(2, 2**70), "max_loaded_loras"),
        (lambda: lora_pin.LoRARegistry(2, max_host_bytes=-(2**70)), "max_host_bytes"),
        (lambda: lora_pin.LoRARegistry(2, chunk_size=2**200), "chunk_size"),
    ],
)
def test_a_limit_past_64_bits_is_a_spec_error_naming_the_range(call: Any, argument: str) -> None:
    with pytest.raises(SpecError, match=rf"{argument} must be an integer in 1\.\.=9223372036854775807 \(got"):
        call()


def _nested(depth: int, container: str) -> object:
    value: object = "x"
    for _ in range(depth):
        value = {"k": value} if container == "dict" else [value]
    return value


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ([_nested(100_000, "dict")], r"item 0 \(\{'k': \{'k': .*has type dict"),
        ([_nested(100_000, "list")], r"item 0 \(\[\[\[.*expected a string or a dict"),
        ({"a": _nested(100_000, "dict")}, r"item 0 .*needs string keys and values"),
    ],
)
def test_a_deeply_nested_item_is_a_spec_error(spec: Any, pattern: str) -> None:
    # Python's repr of the item raised RecursionError while the message was built.
    with pytest.raises(SpecError, match=pattern):
        parse_lora_paths(spec)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_cli_parse_refuses_a_fifo_list_file(tmp_path: pathlib.Path) -> None:
    # Opening a FIFO waits for a writer: it blocked `lora-pin parse` forever (the timeout fails it).
    fifo = tmp_path / "list.json"
    os.mkfifo(fifo)
    out = _cli("parse", "--lora-paths", f"@{fifo}")
    assert out.returncode == 2, out.stderr
    assert "item 0" in out.stderr and "not a regular file" in out.stderr


def test_cli_refuses_an_argument_that_is_not_utf8() -> None:
    # Bytes that are not UTF-8 in the command line reach Python as lone surrogates.
    out = _cli("parse", "--lora-paths", "a=/p\udcff")
    assert out.returncode == 2
    assert (
        "argument 3" in out.stderr and "not valid UTF-8 text" in out.stderr and "Traceback" not in out.stderr
    )
