"""``lora-pin simulate --adapter-size-from``: the simulator's byte model sized from a real adapter, a DoRA
adapter's magnitudes (in its file) and factors (in its slot) counted, against the file's own shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from lora_pin.cli import main
from lora_pin.fixtures import make_peft_adapter


def _moved(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, int]:
    argv = ["simulate", "--workload", "zipf:1.1", "--requests", "300", "--adapters", "12", "--slots", "4"]
    code = main([*argv, "--policy", "lru", "--adapter-size-from", str(path), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    return result["device"]["bytes_moved"], result["device"]["misses"]


def test_dora_magnitudes_and_factors_are_counted(
    tiny_llama: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    plain = make_peft_adapter(tiny_llama, tmp_path / "plain", **kwargs)  # type: ignore[arg-type]
    dora = make_peft_adapter(tiny_llama, tmp_path / "dora", use_dora=True, **kwargs)  # type: ignore[arg-type]
    with safe_open(str(dora / "adapter_model.safetensors"), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    ab = sum(s[0] * s[1] for k, s in shapes.items() if "lora_magnitude_vector" not in k)
    magnitudes = sum(s[0] for k, s in shapes.items() if "lora_magnitude_vector" in k)
    assert magnitudes > 0
    moved, misses = _moved(capsys, plain)
    assert misses > 0 and moved == misses * ab * 4  # fp32 tensors
    moved, misses = _moved(capsys, dora)
    # Each magnitude in the file, and one factor per output feature in the slot.
    assert moved == misses * (ab + 2 * magnitudes) * 4
