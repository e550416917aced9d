"""Slots sized by ``--lora-target-modules``: their memory reported, adapters outside them refused.

vLLM's ``--lora-target-modules`` gives LoRA buffers to the named modules only (the rest of the model's
linear layers get none), which makes each slot smaller: for adapters on q/k/v/o of a Llama, a slot
takes about two fifths of the memory vLLM gives it over every linear layer, so the same memory holds
about two and a half times the slots (docs/vllm.md, "Sizing slots"). vLLM 0.32 then reads an adapter's
weights for every module the model supports and copies only those of the layers that have buffers: an
adapter with weights elsewhere (an MLP, ``lm_head``) is served without them, silently, with other
answers than its own. With the plugin, such an adapter is refused where vLLM's worker reads it, naming
the adapter and its modules outside the targets; nothing is registered and the server serves on.

What a slot costs is logged once the worker has made its LoRA buffers (:func:`slot_memory`), so that
``--max-loras`` can be sized against a memory budget, e.g. for a Llama of hidden 1024 and 8 layers at
``--max-lora-rank 16`` in bfloat16: ``lora_pin: LoRA buffers: 8 slots of 2,097,152 bytes (2.0 MiB),
16.0 MiB in all, on 16 modules (--lora-target-modules k_proj o_proj q_proj v_proj)``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lora_pin.errors import AdapterLoadError

__all__ = ["install", "outside_targets", "slot_memory"]


def install() -> None:
    """Wraps ``WorkerLoRAManager._load_adapter`` (the refusal) and ``LoRAModelManager._create_lora_modules``
    (the report); :func:`lora_pin.vllm.seams.install` calls it once per process."""
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.worker_manager import WorkerLoRAManager

    WorkerLoRAManager._load_adapter = _refusing_outside_targets(WorkerLoRAManager._load_adapter)  # type: ignore[method-assign]
    LoRAModelManager._create_lora_modules = _reporting_slot_memory(LoRAModelManager._create_lora_modules)  # type: ignore[method-assign]


def slot_memory(manager: Any) -> tuple[int, int, int]:
    """``(slots, bytes a slot, LoRA modules)`` of ``manager``'s (vLLM's ``LoRAModelManager``) LoRA
    buffers: every layer's ``lora_a_stacked`` and ``lora_b_stacked`` (a tensor, or a tuple or list of
    them, one per slice of a fused layer), each ``[max_loras, ...]``. Layers that keep their buffers under
    other names (vLLM's MoE layers) are not counted."""
    total = 0
    for module in manager.modules.values():
        for name in ("lora_a_stacked", "lora_b_stacked"):
            stacked = getattr(module, name, None)
            tensors = stacked if isinstance(stacked, (tuple, list)) else [stacked]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    slots = max(1, int(manager.lora_slots))
    return slots, total // slots, len(manager.modules)


def _reporting_slot_memory(create: Any) -> Any:
    """``LoRAModelManager._create_lora_modules`` that logs (INFO, ``vllm.lora_pin.targets``) what its
    buffers cost: :func:`slot_memory`."""
    from vllm.logger import init_logger

    log = init_logger("vllm.lora_pin.targets")

    @functools.wraps(create)
    def _create_lora_modules(self: Any) -> None:
        create(self)
        slots, per_slot, modules = slot_memory(self)
        targets = self.lora_config.target_modules
        which = (
            f"--lora-target-modules {' '.join(sorted(targets))}"
            if targets is not None
            else "every LoRA-capable module: --lora-target-modules narrows them"
        )
        log.info(
            "lora_pin: LoRA buffers: %d slots of %s bytes (%.1f MiB), %.1f MiB in all, on %d modules (%s)",
            slots,
            f"{per_slot:,}",
            per_slot / 2**20,
            slots * per_slot / 2**20,
            modules,
            which,
        )

    return _create_lora_modules


def outside_targets(manager: Any, lora_model: Any) -> list[str]:
    """The modules of ``lora_model`` (vLLM's ``LoRAModel``) with LoRA weights that ``manager`` (its
    ``LoRAModelManager``) gives no buffers under ``--lora-target-modules``, sorted; ``[]`` when every
    module is a target or no targets are set."""
    from vllm.lora.utils import is_in_target_modules

    targets = manager.lora_config.target_modules
    if targets is None:
        return []
    packed = manager.packed_modules_mapping
    # A module vLLM wraps whatever the targets (a classification head) has buffers too.
    return sorted(
        name
        for name in lora_model.loras
        if name not in manager.modules and not is_in_target_modules(name, targets, packed)
    )


def _refusing_outside_targets(load: Any) -> Any:
    """``WorkerLoRAManager._load_adapter`` that raises :class:`AdapterLoadError` for an adapter with
    weights outside ``--lora-target-modules`` (:func:`outside_targets`) instead of returning it."""

    @functools.wraps(load)
    def _load_adapter(self: Any, lora_request: Any) -> Any:
        model = load(self, lora_request)
        outside = outside_targets(self._adapter_manager, model)
        if outside:
            targets = sorted(self._adapter_manager.lora_config.target_modules)
            shown = ", ".join(repr(name) for name in outside[:3])
            more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
            raise AdapterLoadError(
                f"adapter {lora_request.lora_name!r} ({lora_request.lora_path}) has LoRA weights for "
                f"{len(outside)} modules outside --lora-target-modules {' '.join(targets)}: {shown}{more}; "
                f"vLLM would serve it without them. Name its modules in --lora-target-modules"
            )
        return model

    return _load_adapter
