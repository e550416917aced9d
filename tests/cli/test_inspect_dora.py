"""``lora-pin inspect`` on a DoRA adapter: it says DoRA, counts the magnitudes among the tensors and the
factors among the device bytes (from the file's own shapes), and refuses a DoRA config without magnitudes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from lora_pin.cli import main
from lora_pin.fixtures import make_peft_adapter


def test_inspect_shows_dora_and_its_bytes(
    tiny_llama: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = make_peft_adapter(
        tiny_llama,  # type: ignore[arg-type]
        tmp_path / "dora",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        use_dora=True,
    )
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    ab = sum(s[0] * s[1] for k, s in shapes.items() if "magnitude" not in k)
    outs = sum(s[0] for k, s in shapes.items() if "magnitude" in k)
    modules = sum("magnitude" in k for k in shapes)
    assert main(["inspect", str(path), "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert f"tensors:        {len(shapes)}" in out
    assert f"device bytes:   {(ab + outs) * 2} (float16)" in out
    assert f"dora:           yes (a magnitude per output feature of {modules} modules; " in out
    assert f"factors {outs * 2} bytes of the device bytes)" in out

    plain = tmp_path / "no_magnitudes"
    plain.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if "magnitude" not in k}, str(plain / "adapter_model.safetensors")
    )
    (plain / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    assert json.loads((plain / "adapter_config.json").read_text())["use_dora"] is True
    assert main(["inspect", str(plain)]) == 2
    assert "field 'use_dora' is true (DoRA) but module" in capsys.readouterr().err
