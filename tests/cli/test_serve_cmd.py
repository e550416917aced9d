"""``lora-pin serve``'s start-up arithmetic, below the server: the KV cache sized from
``--kv-cache-memory``, the start-up adapters split at the host tier, and adapter names no request could
reach."""

from __future__ import annotations

import pytest
import torch

from lora_pin import LoRARef, SpecError
from lora_pin.cli.serve_cmd import _split_startup, kv_cache_blocks
from lora_pin.serve.adapters import MAX_ADAPTER_NAME_CHARS, check_adapter_name


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
