"""Fixtures of tests/vllm: the vLLM venv ``scripts/vllm_venv.sh`` makes (``scripts/test.sh`` makes it before
pytest runs), a tiny Llama with a character tokenizer and PEFT adapters made here (nothing is downloaded),
and real ``vllm serve`` processes over them (:mod:`vllm_harness`).

vLLM's CPU attention needs ``head_dim >= 32``: the model here has hidden 64 over 2 heads (the shared
``tiny_llama`` has 16). Starting a server costs a minute or two on a busy 2-core machine, so each test
file starts at most one (``module`` scope).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import ADAPTER_SPECS, ALL_LINEARS, MAX_MODEL_LEN, OVERLAY_PYTHON, Oracle, VllmServer

from lora_pin.fixtures import make_peft_adapter, make_tiny_llama, save_char_tokenizer, save_peft_adapter


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of the vLLM venv (overlay with this checkout's lora_pin). ``scripts/test.sh`` makes it
    (and stops if it cannot): under CI a missing venv fails these tests; elsewhere (a developer's pytest
    run without the script) they skip."""
    if not OVERLAY_PYTHON.exists():
        message = "no vLLM venv: run scripts/vllm_venv.sh (scripts/test.sh does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return OVERLAY_PYTHON


@pytest.fixture(scope="session")
def vllm_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """``(model folder, adapter name -> PEFT folder)``: a tiny Llama vLLM's CPU attention serves (hidden
    64, 2 heads of 32, 1 KV head, 2 layers, vocab 128, fp32, 2048 positions) with the char tokenizer,
    and the adapters of :data:`ADAPTER_SPECS` over it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("vllm-world")
    base = make_tiny_llama(root / "base", hidden=64, intermediate=128, heads=2, kv_heads=1, layers=2, seed=3)
    # Room for long streams (test_mixed_batches holds adapters in their slots with them); RoPE has no limit.
    config = json.loads((base / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (base / "config.json").write_text(json.dumps(config))
    save_char_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    dirs = {name: make_peft_adapter(model, root / name, **spec) for name, spec in ADAPTER_SPECS.items()}
    return base, dirs


@pytest.fixture(scope="session")
def dora_dirs(
    vllm_world: tuple[Path, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """PEFT DoRA adapters (``use_dora=True``) over the world's model, magnitudes spread so that every
    factor is far from 1 (:func:`save_peft_adapter`): ``dora1`` every linear, ``down_proj`` at its own
    rank; ``dora2`` rsLoRA on ``q_proj``, ``v_proj`` and ``gate_proj`` (one slice of each fused layer
    left out); ``dora3`` ``k_proj``, ``o_proj`` and ``up_proj``; ``dora_embed``: also ``embed_tokens``
    (DoRA on an embedding, which lora_pin refuses)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("vllm-dora")
    model = AutoModelForCausalLM.from_pretrained(vllm_world[0])
    specs: dict[str, dict[str, Any]] = {
        "dora1": dict(r=8, lora_alpha=16, target_modules=ALL_LINEARS, rank_pattern={"down_proj": 4}),
        "dora2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], use_rslora=True),
        "dora3": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj", "up_proj"]),
        "dora_embed": dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]),
    }
    return {
        name: save_peft_adapter(model, root / name, 30 + i, use_dora=True, **spec)
        for i, (name, spec) in enumerate(specs.items())
    }


@pytest.fixture(scope="session")
def oracle(vllm_world: tuple[Path, dict[str, Path]]) -> Oracle:
    return Oracle(vllm_world[0])


@pytest.fixture(scope="module")
def make_server(
    vllm_python: Path, vllm_world: tuple[Path, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., VllmServer]]:
    """``make(plugin, *args, pinned=names, dirs=None, env=None)``: a started ``vllm serve`` of the world's
    model and adapters (or those of ``dirs``, name -> folder), with the plugin on or off, ``args`` added,
    ``pinned`` marked so in ``--lora-modules`` and ``env`` set; every server made is stopped when the
    module ends."""
    made: list[VllmServer] = []

    def make(
        plugin: bool,
        *args: str,
        pinned: Sequence[str] = (),
        dirs: dict[str, Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        base, world_dirs = vllm_world
        dirs = world_dirs if dirs is None else dirs
        log = tmp_path_factory.mktemp("vllm-log") / "serve.log"
        server = VllmServer(vllm_python, base, dirs, log, plugin, args, pinned, env)
        made.append(server)
        server.start()
        return server

    yield make
    for server in made:
        server.stop()
