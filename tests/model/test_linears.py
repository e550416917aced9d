"""Any linear layer: a framework's own linear class (one returning ``(out, bias)`` included) is wrapped once
registered with ``lora_pin.register_linear``, outputs equal PEFT's; wrappers pass the base layer's
attributes through; an ``nn.Linear`` subclass with its own forward is wrapped, and refused by name at run
time when it returns something else than a tensor."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lora_pin
from lora_pin import LoRAManager
from lora_pin.errors import SpecError

HIDDEN = 16


class FrameworkLinear(torch.nn.Module):
    """A serving framework's linear: its own attribute names, and the bias add left to the caller."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size))
        self.bias = torch.nn.Parameter(torch.empty(output_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(x, self.weight), self.bias


class Router(torch.nn.Linear):
    """A linear subclass whose output is not the linear's (as MoE routers are)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return logits.softmax(-1), logits


class Block(torch.nn.Module):
    def __init__(self, framework: bool) -> None:
        super().__init__()
        self.proj = FrameworkLinear(HIDDEN, HIDDEN) if framework else torch.nn.Linear(HIDDEN, HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, HIDDEN)
        self.router = Router(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if isinstance(y, tuple):
            y = y[0] + y[1]
        gate = self.router(x)[0]
        return x + self.up(torch.relu(y)) * gate.sum(-1, keepdim=True)


class Net(torch.nn.Module):
    """Blocks under ``model.layers.N``, as decoder models nest them (PEFT's layer-index rule)."""

    def __init__(self, framework: bool = False) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Block(framework) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def nets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Net, Net, dict[str, Path]]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    plain = Net()
    framework = Net(framework=True)
    framework.load_state_dict(plain.state_dict())
    root = tmp_path_factory.mktemp("linears")
    paths = {}
    for i, name in enumerate("ab"):
        torch.manual_seed(10 + i)
        cfg = LoraConfig(r=4 - 2 * i, lora_alpha=8, target_modules=["proj", "up"], init_lora_weights=False)
        peft_model = get_peft_model(copy.deepcopy(plain), cfg)
        peft_model.save_pretrained(root / name)
        paths[name] = root / name
    return plain, framework, paths


def peft_reference(
    plain: Net, paths: dict[str, Path], names: list[str | None], x: torch.Tensor
) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(plain), paths["a"], adapter_name="a")
    model.load_adapter(paths["b"], adapter_name="b")
    with torch.no_grad():
        return model(x, adapter_names=[n or "__base__" for n in names])


def test_a_registered_framework_linear_returning_out_and_bias_serves_like_peft(nets: Any) -> None:
    plain, framework, paths = nets
    lora_pin.register_linear(
        FrameworkLinear, features=lambda m: (m.input_size, m.output_size), returns_bias=True
    )
    model = copy.deepcopy(framework)
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in paths.items()], lora_target_modules=["proj", "up"])
    names: list[str | None] = ["a", None, "b", "a"]
    x = torch.randn(4, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), mgr.batch(names):
        got = model(x)
    torch.testing.assert_close(got, peft_reference(plain, paths, names, x), rtol=1e-5, atol=1e-6)
    wrapped = model.model.layers[0].proj
    assert wrapped.weight is framework.model.layers[0].proj.weight or torch.equal(
        wrapped.weight, framework.model.layers[0].proj.weight
    )
    assert (wrapped.input_size, wrapped.output_size) == (HIDDEN, HIDDEN), "attributes pass through"
    mgr.detach()
    assert isinstance(model.model.layers[0].proj, FrameworkLinear)


def test_an_unregistered_framework_linear_is_named_as_missing(nets: Any) -> None:
    _, framework, paths = nets

    class Other(FrameworkLinear):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return F.linear(x, self.weight) * 2, self.bias

    model = copy.deepcopy(framework)
    model.model.layers[0].proj = Other(HIDDEN, HIDDEN)
    model.model.layers[1].proj = Other(HIDDEN, HIDDEN)
    lora_pin.register_linear(
        FrameworkLinear, features=lambda m: (m.input_size, m.output_size), returns_bias=True
    )
    with pytest.raises(SpecError, match="overrides its forward"):
        LoRAManager(model, [f"a={paths['a']}"], lora_target_modules=["proj", "up"])


@pytest.mark.parametrize("modules", [["proj", "up", "router"], ["all"]])
def test_a_linear_subclass_returning_a_tuple_serves_no_adapter_weights_on_it(
    nets: Any, tmp_path: Path, modules: list[str]
) -> None:
    # An nn.Linear subclass with its own forward is wrapped (as PEFT wraps it), its output checked at run
    # time: a router's tuple passes through untouched for adapters without weights on it (their delta
    # there is zero), and an adapter with weights on it is refused naming the module.
    from peft import LoraConfig, get_peft_model

    plain, framework, paths = nets
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["router", "up"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(plain), cfg).save_pretrained(tmp_path / "r")
    lora_pin.register_linear(
        FrameworkLinear, features=lambda m: (m.input_size, m.output_size), returns_bias=True
    )
    model = copy.deepcopy(framework)
    items = [f"a={paths['a']}", f"r={tmp_path / 'r'}"]
    mgr = LoRAManager(model, items, lora_target_modules=modules, max_loras_per_batch=2)
    assert "router" in mgr.targets.module_names
    x = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(5))
    names: list[str | None] = ["a", None]
    with torch.no_grad(), mgr.batch(names):
        got = model(x)
    torch.testing.assert_close(got, peft_reference(plain, paths, names, x), rtol=1e-5, atol=1e-6)
    match = r"'model\.layers\.0\.router' \(Router\) returned tuple, not the tensor a linear layer returns"
    with pytest.raises(SpecError, match=match), torch.no_grad(), mgr.batch(["r", None]):
        model(x)


def test_register_linear_checks_its_arguments() -> None:
    with pytest.raises(SpecError, match=r"not a torch\.nn\.Module subclass"):
        lora_pin.register_linear(int)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="must be callable"):
        lora_pin.register_linear(FrameworkLinear, features=3)  # type: ignore[arg-type]
