"""Adapter weights: reading PEFT adapters, the host tier and the device pools (slots or rank pages)."""

from __future__ import annotations

from lora_pin.weights.config import AdapterConfig
from lora_pin.weights.host_adapter import HostAdapter, HostModule
from lora_pin.weights.host_tier import HostTier, load_adapter
from lora_pin.weights.limits import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_TENSORS,
    MAX_ADAPTER_RANK,
    MAX_CONFIG_BYTES,
)
from lora_pin.weights.paged_pool import PagedDevicePool
from lora_pin.weights.pool import DevicePool, GroupBuffers
from lora_pin.weights.reader import (
    AdapterFile,
    LoraTensorPair,
    adapter_dir_for_name,
    open_adapter,
    read_adapter_config,
    resolve_adapter_dir,
)
from lora_pin.weights.targets import (
    DEFAULT_TARGET_MODULES,
    FUSED_GROUPS,
    LinearTarget,
    LoRATargets,
    TargetGroup,
)

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_TENSORS",
    "DEFAULT_TARGET_MODULES",
    "FUSED_GROUPS",
    "MAX_ADAPTER_RANK",
    "MAX_CONFIG_BYTES",
    "AdapterConfig",
    "AdapterFile",
    "DevicePool",
    "GroupBuffers",
    "HostAdapter",
    "HostModule",
    "HostTier",
    "LinearTarget",
    "LoRATargets",
    "LoraTensorPair",
    "PagedDevicePool",
    "TargetGroup",
    "adapter_dir_for_name",
    "load_adapter",
    "open_adapter",
    "read_adapter_config",
    "resolve_adapter_dir",
]
