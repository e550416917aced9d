"""Fixtures the test files share: one tiny Llama for the whole session, and PEFT adapters made over it.

Every file that serves or loads adapters needs the same small base model (two layers, the defaults of
``lora_pin.fixtures.make_tiny_llama``); it is written and loaded once here instead of once per file.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

MakeAdapters = Callable[[Path, Mapping[str, Mapping[str, Any]]], dict[str, Path]]


@pytest.fixture
def fresh_dynamo() -> None:
    """Forgets every graph ``torch.compile`` made before the test. The LoRA layers' code is shared by every
    model of the session, and Dynamo's recompile limit counts graphs per code object, so without this a
    ``fullgraph=True`` compile fails once enough earlier tests compiled other models."""
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def load_bench() -> Callable[[str], ModuleType]:
    """Imports ``benches/NAME.py`` as module ``bench_NAME``, once a session. It is registered in
    ``sys.modules`` before it runs, where dataclasses look their module up."""

    def load(name: str) -> ModuleType:
        key = f"bench_{name}"
        if key in sys.modules:
            return sys.modules[key]
        path = Path(__file__).resolve().parents[1] / "benches" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's checkpoint folder (2 layers, hidden 64, vocab 128, fp32 safetensors).

    Shared by the session: load models from it, never write into it.
    """
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "base", layers=2)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path) -> torch.nn.Module:
    """The tiny Llama loaded once, to make adapters over and to read targets from.

    Shared by the session: never serve it or change it (load a model from ``tiny_llama_dir``, or deep
    copy this one, for that). ``make_peft_adapter`` wraps it and unwraps it again.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def make_adapters(tiny_llama: torch.nn.Module) -> MakeAdapters:
    """``make(root, specs)``: one PEFT adapter over the tiny Llama per ``name -> make_peft_adapter
    keyword arguments`` entry of ``specs``, saved in ``root / name``; returns ``name -> folder``."""

    def make(root: Path, specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Path]:
        return {name: make_peft_adapter(tiny_llama, root / name, **kwargs) for name, kwargs in specs.items()}

    return make


#: The modules of the shared adapter sets: attention's query and value, or every linear of a layer.
QV = ["q_proj", "v_proj"]
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def qv_world(
    tiny_llama: torch.nn.Module, make_adapters: MakeAdapters, tmp_path_factory: pytest.TempPathFactory
) -> tuple[torch.nn.Module, dict[str, Path]]:
    """The session's tiny Llama (never served: copy it per manager) and adapters a-e of rank 4 over
    ``q_proj`` and ``v_proj``, seeds 1-5."""
    specs = {n: dict(r=4, lora_alpha=8, target_modules=QV, seed=i) for i, n in enumerate("abcde", 1)}
    return tiny_llama, make_adapters(tmp_path_factory.mktemp("qv"), specs)


@pytest.fixture(scope="session")
def linears_world(
    tiny_llama: torch.nn.Module, make_adapters: MakeAdapters, tmp_path_factory: pytest.TempPathFactory
) -> tuple[torch.nn.Module, dict[str, Path]]:
    """The session's tiny Llama (never served: copy it per manager) and adapters a-h of rank 4 over
    every linear of a layer, seeds 1-8."""
    specs = {
        n: dict(r=4, lora_alpha=8, target_modules=ALL_LINEARS, seed=i) for i, n in enumerate("abcdefgh", 1)
    }
    return tiny_llama, make_adapters(tmp_path_factory.mktemp("linears"), specs)
