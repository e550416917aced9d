"""lora_pin: serve many LoRA adapters over one base model at once, with pinned adapters never evicted.

The Rust core (``lora_pin._core``) parses adapter specs, keeps the registry and the two-tier cache, and
plans each scheduler step; this package moves the tensors and runs the multi-adapter LoRA GEMM.
"""

from __future__ import annotations

from lora_pin._core import LoRARef, __version__, check_limits, parse_lora_paths
from lora_pin.args import LoRAConfig, add_lora_args, lora_config_from_args
from lora_pin.errors import (
    AdapterInUseError,
    AdapterLoadError,
    AdapterNotFoundError,
    CapacityError,
    DuplicateAdapterError,
    LoraPinError,
    PathNotAllowedError,
    PoolError,
    SpecError,
    StalePlanError,
    UnloadTimeoutError,
    UnsafeFormatError,
)

__all__ = [
    "AdapterInUseError",
    "AdapterLoadError",
    "AdapterNotFoundError",
    "CapacityError",
    "DuplicateAdapterError",
    "LoRAConfig",
    "LoRARef",
    "LoraPinError",
    "PathNotAllowedError",
    "PoolError",
    "SpecError",
    "StalePlanError",
    "UnloadTimeoutError",
    "UnsafeFormatError",
    "__version__",
    "add_lora_args",
    "check_limits",
    "lora_config_from_args",
    "parse_lora_paths",
]
