"""lora_pin's punica wrapper under ``torch.compile``, as vLLM compiles its forward with the plugin (unless
``LORA_PIN_VLLM_COMPILE=0``; ``in_vllm/compile_check.py``, run in the vLLM venv): one trace for every
step, each step's adapters applied as the eager path applies them, base rows untouched. No server: the
layer calls alone (``test_compiled_serve.py`` runs ``vllm serve`` compiled)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "in_vllm" / "compile_check.py"


@pytest.fixture(scope="module")
def report(vllm_python: Path) -> dict[str, object]:
    done = subprocess.run([str(vllm_python), str(CHECK)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_one_graph_serves_every_step(report: dict[str, object]) -> None:
    # fullgraph=True: a host read of the step's metadata in a layer call would break the graph; five
    # steps of 2 to 23 tokens under one dynamic-shape graph.
    assert report["traced"] == "ok"
    assert report["graphs"] == 1
    assert [s["tokens"] for s in report["steps"]] == [12, 9, 7, 23, 2]  # type: ignore[index,union-attr]


def test_each_step_gets_its_own_adapters_and_base_rows_stay(report: dict[str, object]) -> None:
    for step in report["steps"]:  # type: ignore[union-attr]
        # Against the eager model to float rounding (inductor fuses the rest of the model its own way);
        # the same step under another adapter mix is far off, so a baked-in mix would show.
        assert step["error"] < 1e-5, step
        assert step["base_rows_equal"], step
        if step["tokens"] != 7:  # the base-only step has no adapter to swap
            assert step["swapped_error"] > 0.1, step


def test_the_layer_ops_pass_opcheck(report: dict[str, object]) -> None:
    assert report["opcheck"] == {"vllm_lora_linear_": "ok", "vllm_lora_embedding_": "ok"}


def test_the_seam_keeps_compilation_unless_told_not_to_or_untraceable(report: dict[str, object]) -> None:
    assert report["seam"] == {
        # What the platform gives VLLM_COMPILE without LoRA; vLLM's compile cache off (not keyed by
        # lora_pin's code). Unset is the default: compiled.
        "on": ["DYNAMO_TRACE_ONCE", "1"],
        "unset": ["DYNAMO_TRACE_ONCE", "1"],
        "off": ["NONE", None],
        "misspelt": ["ValueError: LORA_PIN_VLLM_COMPILE must be 0 or 1, got 'yes'", None],
        "fully_sharded": ["NONE", None],  # add_shrink / add_expand are not traceable
        "enforce_eager": ["NONE", None],
        "no_lora": ["DYNAMO_TRACE_ONCE", None],  # vLLM's own decision, untouched
    }
