"""``vllm serve`` without the plugin (``VLLM_PLUGINS=""``), documenting what vLLM 0.32 does on CPU: requests
one at a time are right; its prefix cache keys blocks by name and path (a reload in place reuses the old
weights' blocks; two names with the same weights share nothing); it refuses DoRA adapters at load.

vLLM's wrong base rows in mixed batches are asserted at the layer level, where they are deterministic
(tests/vllm/test_punica.py: its CPU wrapper gives base rows the last slot's adapter in all five methods).
Through the server they are not: whether a base request's steps run its rows beside adapter rows in the
way that picks slot -1 depends on how vLLM's scheduler happens to batch them, and on a quiet machine three
tries in a row came back right, so a server-level assertion of the bug would be a race."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_mixed_batches import SERVER_ARGS
from vllm_harness import Oracle, VllmServer, prompt, reload_in_place, twin_hits


@pytest.fixture(scope="module")
def server(make_server: Callable[..., VllmServer]) -> VllmServer:
    return make_server(False, *SERVER_ARGS)


def test_vllms_own_punica_wrapper_runs_the_layers(server: VllmServer) -> None:
    assert "Using PunicaWrapperCPU." in server.log.read_text(errors="replace")


def test_requests_one_at_a_time_equal_peft(server: VllmServer, oracle: Oracle) -> None:
    for name in [None, "ad1", "ad4"]:
        folder = None if name is None else server.dirs[name]
        assert server.complete(name or server.model, prompt(2), 8) == oracle.tokens(folder, prompt(2), 8)


def test_a_reload_in_place_reuses_the_old_weights_blocks(
    server: VllmServer, oracle: Oracle, tmp_path: Path
) -> None:
    # vLLM keys a LoRA request's blocks by ("lora", name, path) (vLLM #30931): the reload hits the blocks
    # the previous weights computed, and the answer is neither adapter's.
    seen = reload_in_place(server, oracle, tmp_path / "swap", "ad1", "ad7")
    assert seen["before"] == seen["again"] == seen["want_before"]
    assert seen["hits_after"] >= 64
    assert seen["after"] != seen["want_after"]


def test_two_names_with_the_same_weights_share_nothing(
    server: VllmServer, oracle: Oracle, tmp_path: Path
) -> None:
    # Blocks keyed by name and path: the plugin keys them by the weights instead (test_mixed_batches).
    assert twin_hits(server, oracle, tmp_path / "twin") == 0


def test_vllm_refuses_a_dora_adapter(server: VllmServer, dora_dirs: dict[str, Path]) -> None:
    # vLLM 0.32 refuses use_dora at load (the plugin lifts that: test_dora_serve.py). When an upstream
    # release serves DoRA itself, this fails.
    assert "vLLM does not yet support DoRA" in server.refused_load("dora1", dora_dirs["dora1"])
