"""``lora-pin serve``'s start-up arithmetic, below the server: the KV cache sized from
``--kv-cache-memory``, the start-up adapters split at the host tier, and adapter names no request could
reach; ``--page-rank`` / ``--max-lora-memory`` building a paged manager."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import LoRARef, SpecError
from lora_pin.cli.serve_cmd import _split_startup, add_parser, build_server, kv_cache_blocks
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama, save_char_tokenizer
from lora_pin.serve.adapters import MAX_ADAPTER_NAME_CHARS, check_adapter_name
from lora_pin.weights import DevicePool, PagedDevicePool


def test_kv_cache_blocks_fill_the_memory_given() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3, vocab_size=64
    )
    # K and V, 3 layers, 2 KV heads of 32, fp32, 16 tokens a block.
    per_block = 2 * 3 * 2 * 32 * 4 * 16
    assert kv_cache_blocks(config, torch.float32, 16, 1.0) == 2**30 // per_block
    assert kv_cache_blocks(config, torch.bfloat16, 16, 1.0) == 2**30 // (per_block // 2)
    with pytest.raises(SpecError, match="holds no block"):
        kv_cache_blocks(config, torch.float32, 16, 1e-9)


def _ref(name: str, pinned: bool = False) -> LoRARef:
    return LoRARef(lora_name=name, lora_path=f"/a/{name}", pinned=pinned)


def test_start_up_adapters_past_the_host_tier_load_after_the_pinned_and_the_first() -> None:
    refs = (_ref("a"), _ref("p", pinned=True), _ref("b"), _ref("c"), _ref("q", pinned=True), _ref("d"))
    first, later = _split_startup(refs, 4)
    assert [r.lora_name for r in first] == ["a", "p", "b", "q"]
    assert [r.lora_name for r in later] == ["c", "d"]
    first, later = _split_startup(refs, 6)
    assert len(first) == 6 and not later
    with pytest.raises(SpecError, match="2 start-up adapters are pinned"):
        _split_startup(refs, 1)


@pytest.mark.parametrize("name", ["tiny", "tiny:x", "x" * (MAX_ADAPTER_NAME_CHARS + 1), "", "a\nb"])
def test_names_no_request_could_reach_are_refused(name: str) -> None:
    with pytest.raises(SpecError):
        check_adapter_name(name, "tiny")


def test_other_names_are_taken() -> None:
    for name in ("sql", "tinyx", "org/style", "x" * MAX_ADAPTER_NAME_CHARS, "a:b"):
        check_adapter_name(name, "tiny")


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lora-pin")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_page_rank_and_max_lora_memory_build_a_paged_manager(tmp_path: Path) -> None:
    """``--page-rank 8 --max-lora-memory 4MiB`` serve from a paged pool holding 4 MiB, with no bound on
    the adapters of a step but the pages (``--max-loras-per-batch`` bounds them only when given); without
    the flags the slot pool and its 8 slots are as before."""
    base_dir = make_tiny_llama(tmp_path / "base", layers=1)
    save_char_tokenizer(base_dir)
    adapter = make_peft_adapter(base_dir, tmp_path / "r8", r=8, lora_alpha=16, target_modules=["q_proj"])
    common = ["--model", str(base_dir), "--device", "cpu", "--num-blocks", "16", "--page-size", "16"]
    common += ["--lora-paths", f"r8={adapter}", "--log-interval", "0"]
    paged = ["--page-rank", "8", "--max-lora-memory", "4MiB"]

    def fills_the_memory(m: Any) -> bool:
        pool = m.pool
        return bool(pool.nbytes <= 4 << 20 < pool.nbytes + pool.page_nbytes)

    cases: list[tuple[list[str], Callable[[Any], bool]]] = [
        (paged, lambda m: fills_the_memory(m) and m.registry.max_loras_per_batch == m.pool.pages),
        ([*paged, "--max-loras-per-batch", "3"], lambda m: m.registry.max_loras_per_batch == 3),
        ([], lambda m: m.registry.max_loras_per_batch == 8),
    ]
    for flags, check in cases:
        state = build_server(_serve_args(*common, *flags))
        try:
            manager = state.engine.manager
            assert isinstance(manager.pool, PagedDevicePool if flags else DevicePool), flags
            assert check(manager), flags
        finally:
            state.engine.stop()
    with pytest.raises(SpecError, match=r"--page-rank and --max-lora-memory go together \(got --page-rank=8"):
        build_server(_serve_args(*common, "--page-rank", "8"))
    with pytest.raises(SpecError, match=r"max_lora_memory must be bytes: .*'4 furlongs'"):
        build_server(_serve_args(*common, "--page-rank", "8", "--max-lora-memory", "4 furlongs"))
