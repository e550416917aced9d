"""``vllm serve`` with the plugin as it starts by default (``LORA_PIN_VLLM_COMPILE`` unset): vLLM keeps its
compiled forward with LoRA on (its CPU platform runs the model eagerly whenever LoRA is on), and every
completion, the base model, plain LoRA and DoRA adapters mixed concurrently over more adapters than
slots, still equals PEFT's greedy tokens. ``test_dora_serve.py`` runs the same mix eagerly
(``LORA_PIN_VLLM_COMPILE=0``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_mixed_batches import SERVER_ARGS
from vllm_harness import Oracle, VllmServer, base_beside_two_adapters, concurrent_mix

from lora_pin.vllm.dora import KEEP_WEIGHTS_ENV
from lora_pin.vllm.seams import COMPILE_ENV


@pytest.fixture(scope="module")
def server(
    make_server: Callable[..., VllmServer],
    vllm_world: tuple[Path, dict[str, Path]],
    dora_dirs: dict[str, Path],
) -> VllmServer:
    dirs = dict(vllm_world[1])
    dirs.update(dora1=dora_dirs["dora1"], dora3=dora_dirs["dora3"])
    server = make_server(True, *SERVER_ARGS, dirs=dirs, env={KEEP_WEIGHTS_ENV: "1"})
    assert COMPILE_ENV not in server.environment()  # the default, not the harness's choice
    return server


def test_vllm_compiles_its_forward_with_lora_on(server: VllmServer) -> None:
    log = server.log.read_text(errors="replace")
    assert "lora_pin: LoRA with vLLM's compiled forward (compilation mode DYNAMO_TRACE_ONCE;" in log
    assert "Using LoraPinPunicaWrapper." in log
    # vLLM's own account: the mode it runs, and the warm-up that compiles (skipped when eager).
    assert "'mode': <CompilationMode.DYNAMO_TRACE_ONCE: 2>" in log
    assert "Warming up model for the compilation..." in log
    # Compiled afresh: vLLM's compile cache is not keyed by lora_pin's code.
    assert "saved AOT compiled function" not in log


def test_base_lora_and_dora_requests_at_once_equal_peft(server: VllmServer, oracle: Oracle) -> None:
    # The base model, 7 LoRA and 2 DoRA adapters, 3 prompts each, all sent at once over 2 slots.
    assert concurrent_mix(server, oracle) == []


def test_a_base_request_batched_with_two_adapters_equals_peft(server: VllmServer, oracle: Oracle) -> None:
    # The compiled engine runs the two 1500-token streams in a few seconds: a try in which one ends
    # before the base request is made again (it proves nothing about batching), more often than eager.
    base, want = base_beside_two_adapters(server, oracle, "ad1", "ad2")
    assert base == want["base"]
