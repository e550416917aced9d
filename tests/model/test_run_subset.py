"""``LoRAManager.run_subset``: an engine runs a subset of a step's admitted requests, in its own order and
with its own token counts; each row gets its own request's adapter delta (against an fp64 reference from
the adapter's files), and bad subsets are refused with nothing changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from lora_pin import LoRAManager
from lora_pin.errors import LoraPinError, UsageError

MODULE = "model.layers.0.self_attn.q_proj"


@pytest.fixture(params=[None, 2], ids=["whole-segments", "chunks-of-2"])
def setup(
    tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[LoRAManager, dict[str, Path]]:
    from transformers import AutoModelForCausalLM

    dirs = make_adapters(
        tmp_path,
        {n: {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "seed": i} for i, n in enumerate("ab")},
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    items = [f"{n}={d}" for n, d in dirs.items()]
    return LoRAManager(model, items, max_loras_per_batch=2, chunk_size=request.param), dirs


def _delta(folder: Path, x: torch.Tensor) -> torch.Tensor:
    """``scaling * B (A x)`` of the adapter in ``folder`` for ``MODULE``, in fp64."""
    weights = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    a = weights[f"base_model.model.{MODULE}.lora_A.weight"].double()
    b = weights[f"base_model.model.{MODULE}.lora_B.weight"].double()
    return (x.double() @ a.T @ b.T) * (8 / 4)


def test_each_row_gets_its_own_requests_adapter(setup: tuple[LoRAManager, dict[str, Path]]) -> None:
    manager, dirs = setup
    layer = manager.model.get_submodule(MODULE)
    names = ["a", None, "b", "a"]
    step = manager.prepare_step(names, [5, 3, 4, 2])
    assert step.admitted == (0, 1, 2, 3)
    # The engine runs requests 2, 0 and 1 (not 3), with fewer tokens than planned for 2 and 0.
    subset, counts = [2, 0, 1], [3, 1, 2]
    manager.run_subset(step, subset, counts)
    x = torch.randn(sum(counts), layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = layer(x).double()
        base = layer.base_layer(x).double()
    expected = base.clone()
    row = 0
    for request, n in zip(subset, counts, strict=True):
        name = names[request]
        if name is not None:
            expected[row : row + n] += _delta(dirs[name], x[row : row + n])
        row += n
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4:6], base[4:6])  # the base request's rows are untouched
    manager.finish(step)


def test_bad_subsets_are_refused_and_change_nothing(setup: tuple[LoRAManager, dict[str, Path]]) -> None:
    manager, _ = setup
    layer = manager.model.get_submodule(MODULE)
    step = manager.prepare_step(["a", "b"], [2, 2])
    manager.run_subset(step, [1], [2])
    x = torch.randn(2, layer.in_features)
    with torch.no_grad():
        before = layer(x)
    bad = (([0, 0], [1, 1]), ([5], [1]), ([-1], [1]), ([0], [0]), ([0], [-2]), ([0, 1], [1]))
    for requests, counts in bad:
        with pytest.raises(UsageError):
            manager.run_subset(step, requests, counts)
    with torch.no_grad():
        assert torch.equal(layer(x), before)
    manager.finish(step)
    with pytest.raises(LoraPinError, match="not the active one"):
        manager.run_subset(step, [0], [1])
