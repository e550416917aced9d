"""lora_pin's punica wrapper, called as vLLM's layers call it, against an fp64 reference on a mixed batch
(``in_vllm/punica_check.py``, run in the vLLM venv). No server: this is the layer math alone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "in_vllm" / "punica_check.py"
METHODS = ["linear_fused", "linear", "shrink_expand", "embedding", "logits"]


@pytest.fixture(scope="module")
def report(vllm_python: Path) -> dict[str, dict[str, object]]:
    done = subprocess.run([str(vllm_python), str(CHECK)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_adapter_rows_equal_the_reference_at_each_slots_own_rank(
    report: dict[str, dict[str, object]],
) -> None:
    # Each slot's buffers hold large values past its adapter's rank: multiplying the padding shows here.
    errors = report["errors"]
    # linear_without: a slot whose adapter has no weights in the layer is not multiplied there;
    # linear_silent: a layer no adapter has weights for is left alone (embedding_*: the same for a token
    # embedding).
    extra = {"linear_next_step", "linear_without", "linear_silent", "embedding_without", "embedding_silent"}
    assert set(errors) == {*METHODS, *extra}
    for method, error in errors.items():
        assert isinstance(error, float) and error < 1e-4, (method, error)


def test_base_rows_are_never_touched(report: dict[str, dict[str, object]]) -> None:
    assert report["base_rows_touched"] == dict.fromkeys(METHODS, False)


def test_vllms_own_cpu_wrapper_gives_base_rows_the_last_slot(report: dict[str, dict[str, object]]) -> None:
    # vLLM's torch ops gather lora_b_weights[-1] for a base token. When an upstream release fixes that,
    # this fails: the plugin's wrapper is then no longer needed for correctness, only for speed.
    assert report["vllm_base_rows_touched"] == dict.fromkeys(METHODS, True)
