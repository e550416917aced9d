"""Model integration: LoRA layers wrapped around a model's linears, and the manager facade."""

from __future__ import annotations

from lora_pin.model.layers import LoRALinear, StepSegments
from lora_pin.model.manager import LoRAManager, Step

__all__ = ["LoRALinear", "LoRAManager", "Step", "StepSegments"]
