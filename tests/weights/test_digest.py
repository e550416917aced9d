"""The content digest of a host-tier load: the same weights give one digest whatever the folder, file layout,
format, serving dtype or process; one changed element, alpha or rank gives another."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin.weights import LoRATargets, load_adapter
from lora_pin.weights.digest import tensor_digest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEY = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, make_adapters: Callable[..., dict[str, Path]]) -> Path:
    root = tmp_path_factory.mktemp("digest")
    return make_adapters(root, {"a": dict(r=4, lora_alpha=8, target_modules=ALL, seed=7)})["a"]


def digest(path: Path, targets: LoRATargets, **kwargs: object) -> str:
    kwargs.setdefault("dtype", torch.float32)
    return load_adapter("a", path, targets, max_rank=8, pin_memory=False, **kwargs).digest  # type: ignore[arg-type]


def variant(
    source: Path, target: Path, tensors: dict[str, torch.Tensor] | None = None, **config: object
) -> Path:
    shutil.copytree(source, target)
    if tensors is not None:
        save_file(tensors, target / "adapter_model.safetensors")
    if config:
        fields = json.loads((source / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**fields, **config}))
    return target


def test_the_same_weights_give_one_digest(adapter: Path, tiny_llama: torch.nn.Module, tmp_path: Path) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    want = digest(adapter, targets)
    assert len(want) == 64 and int(want, 16) >= 0
    tensors = load_file(adapter / "adapter_model.safetensors")
    reordered = dict(reversed(list(tensors.items())))
    layouts = {
        "copy": variant(adapter, tmp_path / "copy"),
        # Another header order and a __metadata__ entry: the same tensors.
        "layout": variant(adapter, tmp_path / "layout"),
        # A field that serves nothing.
        "described": variant(adapter, tmp_path / "described", base_model_name_or_path="elsewhere"),
    }
    save_file(reordered, layouts["layout"] / "adapter_model.safetensors", metadata={"format": "pt", "x": "y"})
    for name, folder in layouts.items():
        assert digest(folder, targets) == want, name
    # The stored bytes are hashed, not the serving dtype's.
    assert digest(adapter, targets, dtype=torch.bfloat16) == want
    # adapter_model.bin holding the same tensors.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapter / "adapter_config.json", pickled)
    torch.save(tensors, pickled / "adapter_model.bin")
    assert digest(pickled, targets, allow_pickle=True) == want


def test_any_served_change_gives_another_digest(
    adapter: Path, tiny_llama: torch.nn.Module, tmp_path: Path
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    tensors = load_file(adapter / "adapter_model.safetensors")
    ulp = dict(tensors)
    ulp[KEY] = tensors[KEY].clone()
    ulp[KEY][3, 1] = torch.nextafter(ulp[KEY][3, 1], torch.tensor(float("inf")))
    half = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    variants = {
        "ulp": variant(adapter, tmp_path / "ulp", ulp),
        "alpha": variant(adapter, tmp_path / "alpha", lora_alpha=9),
        "alpha_pattern": variant(adapter, tmp_path / "alpha_pattern", alpha_pattern={"down_proj": 2}),
        "rslora": variant(adapter, tmp_path / "rslora", use_rslora=True),
        # The same values stored in another dtype are other bytes.
        "bf16": variant(adapter, tmp_path / "bf16", half),
    }
    seen = {"original": digest(adapter, targets)}
    for name, folder in variants.items():
        seen[name] = digest(folder, targets)
    assert len(set(seen.values())) == len(seen), seen


def test_the_digest_is_the_same_in_another_process(
    adapter: Path, tiny_llama_dir: Path, tiny_llama: torch.nn.Module
) -> None:
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from lora_pin.weights import LoRATargets, load_adapter\n"
        "targets = LoRATargets.from_model(AutoModelForCausalLM.from_pretrained(sys.argv[1]))\n"
        "print(load_adapter('a', sys.argv[2], targets, max_rank=8, dtype=torch.float32).digest)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama_dir), str(adapter)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert done.stdout.strip().splitlines()[-1] == digest(adapter, LoRATargets.from_model(tiny_llama))


def test_tensor_digests_cover_name_dtype_shape_and_bytes() -> None:
    data = torch.arange(6, dtype=torch.float32)
    raw = data.view(torch.uint8).numpy().data
    base = tensor_digest("t", "F32", (2, 3), raw)
    assert tensor_digest("t", "F32", (2, 3), bytes(raw)) == base
    others = [
        tensor_digest("u", "F32", (2, 3), raw),
        tensor_digest("t", "I32", (2, 3), raw),
        tensor_digest("t", "F32", (3, 2), raw),
        tensor_digest("t", "F32", (6,), raw),
        tensor_digest("t", "F32", (2, 3), data.add(1).view(torch.uint8).numpy().data),
    ]
    assert len({base, *others}) == 6


def test_a_forked_child_gives_the_same_digest(adapter: Path, tiny_llama: torch.nn.Module) -> None:
    import os
    import signal

    targets = LoRATargets.from_model(tiny_llama)
    want = digest(adapter, targets)  # this process has read and hashed before the fork
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a child waiting on a thread it does not have dies instead of hanging
        try:
            os._exit(0 if digest(adapter, targets) == want else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
