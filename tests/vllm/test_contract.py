"""The contract with vLLM: every seam the plugin uses is where the plugin expects it (fails loudly, naming
the seam, when a vLLM release moves one), and the plugin runs only when ``VLLM_PLUGINS`` names it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "in_vllm" / "contract_check.py"


def run_check(python: Path, plugins: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    mode = "on" if plugins and "lora_pin" in plugins else "off"
    done = subprocess.run(
        [str(python), str(CHECK), mode], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("plugins", "loaded"),
    [("lora_pin", True), (None, False), ("", False)],
    ids=["named", "unset", "empty"],
)
def test_every_seam_holds_and_the_plugin_runs_only_when_named(
    vllm_python: Path, plugins: str | None, loaded: bool
) -> None:
    # Unset VLLM_PLUGINS makes vLLM load every general plugin: lora_pin's must still do nothing then,
    # since replacing the LoRA math has to be asked for.
    report = run_check(vllm_python, plugins)
    assert report["broken"] == []
    assert report["loaded"] is loaded
