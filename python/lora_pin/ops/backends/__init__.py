"""Backends: how the LoRA layers' work runs on a device, behind one interface (:class:`LoRABackend`).

One file per device, one instance per model, chosen once by :func:`backend_for` from the device the pool
lives on (as vLLM's ``punica_wrapper`` does): the layers never look at the device.

- :class:`CpuBackend`: CPU tensors; each group's work checked and planned once per step, then the native
  AVX-512 kernels or grouped torch GEMMs by its plan.
- :class:`CudaBackend`: CUDA tensors; the Triton kernels through the registered ops, capturable.
- :class:`TorchOpsBackend`: the registered ops alone; what ``torch.compile`` traces (the other backends
  hand their work to it while traced) and what every other device runs.
"""

from __future__ import annotations

import torch

from lora_pin.ops.backends.base import LoRABackend, SplitDelta, StepRows
from lora_pin.ops.backends.cpu import CpuBackend, CpuStepKernels
from lora_pin.ops.backends.cuda import CudaBackend
from lora_pin.ops.backends.fallback import TorchOpsBackend

__all__ = [
    "CpuBackend",
    "CpuStepKernels",
    "CudaBackend",
    "LoRABackend",
    "SplitDelta",
    "StepRows",
    "TorchOpsBackend",
    "backend_for",
]


def backend_for(device: torch.device | str) -> LoRABackend:
    """A new backend for a model whose adapter pool lives on ``device``."""
    kind = torch.device(device).type
    if kind == "cpu":
        return CpuBackend()
    if kind == "cuda":
        return CudaBackend()
    return TorchOpsBackend()
