"""lora_pin: serve many LoRA adapters over one base model at once, with pinned adapters never evicted.

The Rust core (``lora_pin._core``) parses adapter specs, keeps the registry and the two-tier cache, and
plans each scheduler step; this package moves the tensors and runs the multi-adapter LoRA GEMM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lora_pin._core import (
    LoRARef,
    LoRARegistry,
    StepPlan,
    Trace,
    __version__,
    check_limits,
    parse_lora_paths,
    simulate,
)
from lora_pin.args import (
    LoRAConfig,
    add_lora_args,
    add_vllm_lora_args,
    lora_config_from_args,
    lora_config_from_vllm_args,
)
from lora_pin.errors import (
    AdapterBusyError,
    AdapterInUseError,
    AdapterLoadError,
    AdapterNotFoundError,
    CapacityError,
    DuplicateAdapterError,
    LoraPinError,
    OpArgumentError,
    PathNotAllowedError,
    PoolError,
    SpecError,
    StalePlanError,
    UnloadTimeoutError,
    UnsafeFormatError,
    UsageError,
)
from lora_pin.unloading import unload_async

if TYPE_CHECKING:
    from lora_pin.model import LoRAManager, Step
    from lora_pin.weights import (
        AdapterConfig,
        DevicePool,
        HostAdapter,
        HostTier,
        LoRATargets,
        PagedDevicePool,
        load_adapter,
    )
    from lora_pin.weights.targets import register_linear

# Names whose modules import torch load on first use: `import lora_pin` and `lora-pin parse` stay fast.
_LAZY = {
    "LoRAManager": "lora_pin.model",
    "Step": "lora_pin.model",
    "AdapterConfig": "lora_pin.weights",
    "DevicePool": "lora_pin.weights",
    "HostAdapter": "lora_pin.weights",
    "HostTier": "lora_pin.weights",
    "LoRATargets": "lora_pin.weights",
    "PagedDevicePool": "lora_pin.weights",
    "load_adapter": "lora_pin.weights",
    "register_linear": "lora_pin.weights.targets",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lora_pin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AdapterBusyError",
    "AdapterConfig",
    "AdapterInUseError",
    "AdapterLoadError",
    "AdapterNotFoundError",
    "CapacityError",
    "DevicePool",
    "DuplicateAdapterError",
    "HostAdapter",
    "HostTier",
    "LoRAConfig",
    "LoRAManager",
    "LoRARef",
    "LoRARegistry",
    "LoRATargets",
    "LoraPinError",
    "OpArgumentError",
    "PagedDevicePool",
    "PathNotAllowedError",
    "PoolError",
    "SpecError",
    "StalePlanError",
    "Step",
    "StepPlan",
    "Trace",
    "UnloadTimeoutError",
    "UnsafeFormatError",
    "UsageError",
    "__version__",
    "add_lora_args",
    "add_vllm_lora_args",
    "check_limits",
    "load_adapter",
    "lora_config_from_args",
    "lora_config_from_vllm_args",
    "parse_lora_paths",
    "register_linear",
    "simulate",
    "unload_async",
]
