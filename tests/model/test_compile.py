"""Whole-model ``torch.compile(fullgraph=True)`` under ``LoRAManager.batch``: the step's segments for every
input length are derived without data-dependent shapes, so the graph has no break and no guard on data."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import LoRAManager

# Each test compiles from a clean slate (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(make_adapters: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    specs = {
        "a": dict(r=4, lora_alpha=8, target_modules=TARGETS, seed=1),
        "b": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], seed=2),
    }
    return make_adapters(tmp_path_factory.mktemp("compile"), specs)


def run(model: Any, mgr: LoRAManager, names: list[str | None], ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prefill of ``ids`` and of one decode token after it, in one batch."""
    with torch.no_grad(), mgr.batch(names):
        prefill = model(ids).logits
        decode = model(ids[:, -1:]).logits
    return [prefill, decode]


# A slot pool, and a pool of rank-2 pages (adapter "a" of rank 4 takes two, not contiguous after churn).
POOLS = {"slots": dict(max_loras_per_batch=3), "pages": dict(page_rank=2, max_lora_memory="256KiB")}


@pytest.mark.parametrize("pool", POOLS)
def test_fullgraph_compile_under_batch_equals_eager(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path], pool: str
) -> None:
    model = copy.deepcopy(tiny_llama)
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in adapters.items()], **POOLS[pool])
    names: list[str | None] = ["a", None, "b", "a"]
    ids = torch.randint(0, 128, (4, 6), generator=torch.Generator().manual_seed(0))
    want = run(model, mgr, names, ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = run(compiled, mgr, names, ids)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_chunked_segments_of_a_long_input_serve_the_same_rows(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    """Chunks of each sequence's rows (as CUDA uses) give the outputs whole segments give."""
    items = [f"{n}={p}" for n, p in adapters.items()]
    whole = LoRAManager(copy.deepcopy(tiny_llama), items, max_loras_per_batch=3)
    chunked_model = copy.deepcopy(tiny_llama)
    chunked = LoRAManager(chunked_model, items, max_loras_per_batch=3, chunk_size=2)
    names: list[str | None] = ["b", "a", None]
    ids = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(1))
    for g, w in zip(
        run(chunked_model, chunked, names, ids), run(whole.model, whole, names, ids), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
