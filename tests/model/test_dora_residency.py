"""DoRA adapters through pins, background loading and a compiled step, against PEFT's forward.

Every adapter row is compared with PEFT's single-adapter forward of the same batch (PEFT refuses
``adapter_names`` with DoRA) and every base row with the plain model bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import LoRAManager
from lora_pin.fixtures import save_peft_adapter

# Each test compiles from a clean slate (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RTOL, ATOL = 2e-4, 2e-5


World = tuple[torch.nn.Module, dict[str, Path], dict[str, torch.Tensor], torch.Tensor]


def _ids() -> torch.Tensor:
    return torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def world(tiny_llama: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> World:
    """The tiny Llama, two DoRA adapters, three plain ones, PEFT's logits of the batch ``[adapter, base]``
    with each adapter alone, and the plain model's."""
    from peft import PeftModel

    base = copy.deepcopy(tiny_llama).eval()
    root = tmp_path_factory.mktemp("dora-residency")
    adapters = {
        "dora": save_peft_adapter(
            base, root / "dora", 1, r=4, lora_alpha=8, target_modules=ALL, use_dora=True
        ),
        "dora2": save_peft_adapter(
            base, root / "dora2", 2, r=8, lora_alpha=4, target_modules=["q_proj", "down_proj"], use_dora=True
        ),
    }
    for i in range(3):
        adapters[f"lora{i}"] = save_peft_adapter(
            base, root / f"lora{i}", 10 + i, r=4, lora_alpha=8, target_modules=ALL
        )
    ids = _ids()
    with torch.no_grad():
        want = {
            name: PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()(input_ids=ids).logits
            for name, path in adapters.items()
        }
        plain = base(input_ids=ids).logits
    return base, adapters, want, plain


def _check(got: torch.Tensor, world: World, name: str) -> None:
    _, _, want, plain = world
    torch.testing.assert_close(got[0], want[name][0], rtol=RTOL, atol=ATOL, msg=name)
    assert torch.equal(got[1], plain[1])


@pytest.mark.parametrize("loading", ["blocking", "background"])
def test_pinned_dora_adapter_stays_and_serves_while_others_churn(world: World, loading: str) -> None:
    """Two slots, two host entries, one DoRA adapter pinned: plain adapters churn through the other slot
    and the host tier, evicting each other; the pinned one is never evicted and its rows stay PEFT's."""
    base, adapters, _, _ = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model,
        [f'{{"lora_name": "dora", "lora_path": "{adapters["dora"]}", "pinned": true}}'],
        max_loras_per_batch=2,
        max_loaded_loras=2,
        max_lora_rank=8,
        loading=loading,
    )
    for i in range(3):
        mgr.load(f"lora{i}", adapters[f"lora{i}"])
    ids = _ids()
    for name in ["lora0", "dora", "lora1", "lora2", "dora", "lora0", "dora"]:
        with torch.no_grad(), mgr.batch([name, None]):
            got = model(input_ids=ids).logits
        _check(got, world, name)
    evictions = mgr.stats()["evictions_by_adapter"]
    assert not any(key.startswith("dora/") for key in evictions), evictions
    assert sum(evictions.values()) >= 4, evictions


def test_dora_adapters_read_by_background_loading(world: World) -> None:
    """Background loading (the default): a DoRA adapter evicted from host memory is deferred by the next
    step and read again on the loader's threads, its factors computed there; once installed, its rows
    are PEFT's."""
    base, adapters, _, _ = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model, [f"dora={adapters['dora']}"], max_loras_per_batch=1, max_loaded_loras=1, max_lora_rank=8
    )
    mgr.load("dora2", adapters["dora2"])  # the host tier holds one adapter: dora goes back to disk
    ids = _ids()
    for name in ["dora", "dora2", "dora"]:
        assert name not in mgr.host
        step = mgr.prepare_step([name, None], 1)
        assert step.admitted == (1,) and step.loading == (0,), (step.admitted, step.loading)
        mgr.finish(step)
        assert mgr.wait_loads(timeout=30.0)
        with torch.no_grad(), mgr.batch([name, None]):
            got = model(input_ids=ids).logits
        _check(got, world, name)
    assert mgr.stats()["background_loads"] >= 3


def test_compiled_before_any_dora_adapter_rescales_later_dora_rows(world: World) -> None:
    """A step traced (fullgraph) while the pool held only a plain adapter already holds the DoRA rescale
    (the traced path reads no Python-side DoRA state, only the slots' flags on the device), so a graph
    captured then rescales a DoRA adapter loaded later; served so, its rows are PEFT's."""
    base, adapters, _, _ = world
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"lora0={adapters['lora0']}"], max_loras_per_batch=1, max_lora_rank=8)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    ids = _ids()
    with torch.no_grad(), mgr.batch(["lora0", None]):
        got = compiled(ids).logits
    _check(got, world, "lora0")
    assert len(graphs) == 1
    rescales = [n for n in graphs[0].graph.nodes if "dora_scale_" in str(n.target)]
    assert len(rescales) == len(ALL) * 2  # every wrapped layer of both decoder layers
    mgr.load("dora", adapters["dora"])
    with torch.no_grad(), mgr.batch(["dora", None]):
        got = compiled(ids).logits
    _check(got, world, "dora")
