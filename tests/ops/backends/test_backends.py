"""The backends behind the LoRA layers: chosen once by device, and the torch-ops one (what
``torch.compile`` traces) against the fp64 reference through a layer; and the rule that the layers
never look at the device themselves."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

import lora_pin.model
from lora_pin._testing import random_layer, request_slots
from lora_pin.model.layers import LoRALinear
from lora_pin.model.segments import StepSegments
from lora_pin.ops import lora_reference, segments_from_slots
from lora_pin.ops.backends import CpuBackend, CudaBackend, TorchOpsBackend, backend_for


def test_a_backend_is_chosen_by_the_pools_device() -> None:
    assert type(backend_for("cpu")) is CpuBackend
    assert type(backend_for(torch.device("cuda", 1))) is CudaBackend
    assert type(backend_for("meta")) is TorchOpsBackend


class _Output(torch.nn.Module):
    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_torch_ops_backend_runs_a_layer_through_the_registered_ops(
    dtype: torch.dtype, op_calls: Any
) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = random_layer(6, 32, [48, 16, 16], [8, (4, 0, 8)], dtype, gen)
    token_slots = torch.repeat_interleave(request_slots("zipf", 8, 6, gen, base_fraction=0.25), 3)
    x = torch.randn(token_slots.shape[0], 32, generator=gen).to(dtype)
    out = torch.randn(token_slots.shape[0], 80, generator=gen).to(dtype)
    buffers = types.SimpleNamespace(
        group=types.SimpleNamespace(n_slices=3, key="qkv"),
        a=layer.a,
        b=layer.b,
        ranks=layer.slot_ranks,
        scalings=layer.slot_scalings,
        slice_offsets=layer.slice_offsets,
        dora_slots=None,
        page_rank=None,
    )
    step = StepSegments(segments=segments_from_slots(token_slots), any_adapter=True)
    module = LoRALinear(_Output(got := out.clone()), buffers, lambda: step, backend=TorchOpsBackend())  # type: ignore[arg-type]
    with torch.inference_mode(), op_calls() as ops:
        module(x)
    assert ops.ours == ["lora_pin.shrink.default", "lora_pin.expand.default"]
    want = lora_reference(out, x, layer.a, layer.b, token_slots, *layer[2:])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])


def test_the_layers_never_look_at_the_device() -> None:
    """Which path runs is the backend's decision (:mod:`lora_pin.ops.backends`), never a layer's."""
    package = Path(lora_pin.model.__file__).parent
    looks = ("device.type", "is_compiling", "is_cuda", "is_cpu", "stream_capturing")
    found = [
        f"{name}: {look}"
        for name in ("layers.py", "parallel_layers.py", "experts.py")
        for look in looks
        if look in (package / name).read_text()
    ]
    assert not found, found
