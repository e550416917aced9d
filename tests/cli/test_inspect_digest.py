"""``lora-pin inspect`` prints the digest a manager gives the adapter, with and without ``--model``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lora_pin import LoRAManager
from lora_pin.cli import main


def test_inspect_prints_the_managers_digest(
    tmp_path: Path,
    tiny_llama: torch.nn.Module,
    tiny_llama_dir: Path,
    make_adapters: Callable[..., dict[str, Path]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], alpha_pattern={"q_proj": 2})
    adapter = make_adapters(tmp_path, {"a": spec})["a"]
    mgr = LoRAManager(copy.deepcopy(tiny_llama), [f"a={adapter}"])
    want = mgr.identity("a").digest
    for extra in ([], ["--model", str(tiny_llama_dir)]):
        assert main(["inspect", str(adapter), *extra]) == 0
        lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
        assert lines["digest"].strip() == want, extra
