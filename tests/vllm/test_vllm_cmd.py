"""``lora-pin vllm-serve``, the one switch: what it adds to ``VLLM_PLUGINS`` and what it runs (no vLLM
needed; tests/vllm/test_mixed_batches.py starts its servers through it)."""

from __future__ import annotations

import sys

import pytest

from lora_pin.cli.vllm_cmd import plugin_environment, vllm_serve_command
from lora_pin.errors import SpecError


def test_it_names_lora_pin_beside_the_plugins_already_named() -> None:
    assert plugin_environment({"VLLM_PLUGINS": "a, b"})["VLLM_PLUGINS"] == "a,b,lora_pin"
    assert plugin_environment({"VLLM_PLUGINS": "lora_pin"})["VLLM_PLUGINS"] == "lora_pin"
    assert plugin_environment({"VLLM_PLUGINS": ""})["VLLM_PLUGINS"] == "lora_pin"


def test_unset_it_keeps_every_installed_general_plugin() -> None:
    # Unset, vLLM loads every installed general plugin: the switch must not turn the others off.
    from importlib.metadata import entry_points

    installed = {e.name for e in entry_points(group="vllm.general_plugins")}
    named = set(plugin_environment({"PATH": "/bin"})["VLLM_PLUGINS"].split(","))
    assert named == installed | {"lora_pin"}


def test_it_runs_vllm_serve_in_this_python_with_the_scheduler_and_pins_taken_out() -> None:
    items = [
        '{"name": "a", "path": "/a", "pinned": true}',
        "b=/b",
        '{"name": "c", "path": "/c", "pinned": false}',
    ]
    command, pinned = vllm_serve_command(["/m", "--lora-modules", *items, "--port", "9"])
    served = ['{"name": "a", "path": "/a"}', "b=/b", '{"name": "c", "path": "/c"}']
    assert command == [
        *(sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m", "--lora-modules", *served),
        *("--port", "9", "--scheduler-cls", "lora_pin.vllm.Scheduler"),
    ]
    assert pinned == ["a"]
    # A scheduler the user names is kept.
    command, _ = vllm_serve_command(["/m", "--scheduler-cls=x.Y"])
    assert command[-1] == "--scheduler-cls=x.Y"


def test_a_pinned_that_is_not_a_boolean_is_refused() -> None:
    with pytest.raises(SpecError, match="'pinned' must be true or false"):
        vllm_serve_command(["/m", "--lora-modules", '{"name": "a", "path": "/a", "pinned": "yes"}'])
