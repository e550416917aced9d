"""Model integration: LoRA layers wrapped around a model's linears, and the manager facade."""

from __future__ import annotations

from lora_pin.model.layers import LoRALinear
from lora_pin.model.manager import LoRAManager, Step
from lora_pin.model.segments import StepSegments

__all__ = ["LoRALinear", "LoRAManager", "Step", "StepSegments"]
