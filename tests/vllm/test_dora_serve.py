"""``vllm serve`` with the plugin serves DoRA adapters (vLLM 0.32 refuses them: test_vllm_alone.py): every
completion, DoRA adapters mixed concurrently with base and plain LoRA requests over more adapters than
slots, equals PEFT's greedy tokens; DoRA on an embedding is refused at load, naming the adapter and the
module, and the server serves on. The server runs eagerly (``LORA_PIN_VLLM_COMPILE=0``): the mix is
served compiled, the default, in ``test_compiled_serve.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_mixed_batches import SERVER_ARGS
from vllm_harness import Oracle, VllmServer, concurrent_mix, prompt

from lora_pin.vllm.dora import KEEP_WEIGHTS_ENV
from lora_pin.vllm.seams import COMPILE_ENV


@pytest.fixture(scope="module")
def server(
    make_server: Callable[..., VllmServer],
    vllm_world: tuple[Path, dict[str, Path]],
    dora_dirs: dict[str, Path],
) -> VllmServer:
    # Three DoRA adapters and two plain ones over --max-loras 2 and --max-cpu-loras 4: slots are reused
    # between DoRA and plain adapters, and adapters are evicted and read again.
    dirs = {name: dora_dirs[name] for name in ("dora1", "dora2", "dora3")}
    dirs.update(ad1=vllm_world[1]["ad1"], ad4=vllm_world[1]["ad4"])
    return make_server(True, *SERVER_ARGS, dirs=dirs, env={KEEP_WEIGHTS_ENV: "1", COMPILE_ENV: "0"})


def test_the_model_runs_eagerly_when_told_to(server: VllmServer) -> None:
    log = server.log.read_text(errors="replace")
    assert "lora_pin: LoRA with vLLM's compiled forward" not in log
    assert "Warming up model for the compilation..." not in log


def test_dora_base_and_lora_requests_at_once_equal_peft(server: VllmServer, oracle: Oracle) -> None:
    # 18 requests over the base model, 3 DoRA and 2 plain LoRA adapters, all sent at once.
    assert concurrent_mix(server, oracle) == []


def test_dora_on_an_embedding_is_refused_naming_the_adapter_and_module(
    server: VllmServer, oracle: Oracle, dora_dirs: dict[str, Path]
) -> None:
    message = server.refused_load("dora_embed", dora_dirs["dora_embed"])
    assert "adapter 'dora_embed'" in message
    assert "module 'model.embed_tokens'" in message
    assert "linear layers only" in message
    # Nothing changed: the name is not served (refused_load checks), and the DoRA adapters still are.
    want = oracle.tokens(server.dirs["dora1"], prompt(4), 8)
    assert server.complete("dora1", prompt(4), 8) == want
