"""``vllm serve`` with the plugin: every completion in batches that mix the base model and adapters
equals PEFT's greedy tokens (vLLM's own CPU path gets the base rows wrong: test_vllm_alone.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_harness import (
    Oracle,
    VllmServer,
    base_beside_two_adapters,
    concurrent_mix,
    long_prompt,
    prefix_cache_hits,
    reload_in_place,
    twin_hits,
)

from lora_pin.vllm.dora import KEEP_WEIGHTS_ENV

SERVER_ARGS = (
    *("--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8", "--max-num-seqs", "32"),
    *("--block-size", "32"),
)


@pytest.fixture(scope="module")
def server(make_server: Callable[..., VllmServer]) -> VllmServer:
    return make_server(True, *SERVER_ARGS)


def test_the_plugins_punica_wrapper_runs_the_layers(server: VllmServer) -> None:
    assert "Using LoraPinPunicaWrapper." in server.log.read_text(errors="replace")


def test_base_and_seven_adapters_at_once_equal_peft(server: VllmServer, oracle: Oracle) -> None:
    # 24 requests over the base and 7 adapters (ranks 4 and 8 under --max-lora-rank 8), 2 slots.
    assert concurrent_mix(server, oracle) == []


def test_a_base_request_batched_with_two_adapters_equals_peft(server: VllmServer, oracle: Oracle) -> None:
    base, want = base_beside_two_adapters(server, oracle, "ad1", "ad2")
    assert base == want["base"]


def test_a_reload_in_place_never_reuses_a_block_of_the_old_weights(
    server: VllmServer, oracle: Oracle, tmp_path: Path
) -> None:
    # ad1 and ad7 share rank, alpha and targets: only the weights differ.
    seen = reload_in_place(server, oracle, tmp_path / "swap", "ad1", "ad7")
    assert seen["before"] == seen["again"] == seen["want_before"]
    assert seen["hits_again"] >= 64  # the same weights share the prompt's blocks
    assert seen["hits_after"] == 0
    assert seen["after"] == seen["want_after"]


def test_a_users_cache_salt_is_kept_beside_the_digest(server: VllmServer, oracle: Oracle) -> None:
    ids = long_prompt(1)
    want = oracle.tokens(server.dirs["ad2"], ids, 4)
    assert server.complete("ad2", ids, 4, cache_salt="u1") == want
    hits = prefix_cache_hits(server)
    assert server.complete("ad2", ids, 4, cache_salt="u1") == want
    assert prefix_cache_hits(server) - hits >= 64
    hits = prefix_cache_hits(server)
    assert server.complete("ad2", ids, 4, cache_salt="u2") == want
    assert prefix_cache_hits(server) - hits == 0


def test_two_names_with_the_same_weights_share_blocks(
    server: VllmServer, oracle: Oracle, tmp_path: Path
) -> None:
    assert twin_hits(server, oracle, tmp_path / "twin") >= 64


def test_dora_without_the_kept_base_weights_is_refused_saying_how(
    server: VllmServer, dora_dirs: dict[str, Path]
) -> None:
    # vLLM's CPU path drops each linear layer's plain weight once packed; DoRA's norms need it, kept
    # only with LORA_PIN_VLLM_DORA=1 (test_dora_serve.py), which this server was not given.
    message = server.refused_load("dora1", dora_dirs["dora1"])
    assert "adapter 'dora1'" in message
    assert f"start vLLM with {KEEP_WEIGHTS_ENV}=1" in message
