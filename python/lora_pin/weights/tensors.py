"""Adapters handed over in memory: a mapping of PEFT tensor names to tensors and a PEFT config.

A training loop that pushes new weights every few minutes has them in memory already (PEFT's
``get_peft_model_state_dict``); writing them to disk only to read them back costs a round trip. An adapter
handed over this way goes through every check of a load from disk (the config's fields, names, shapes,
ranks, finiteness, the limits on tensor count and bytes) with the same errors, and gets the same digest as
the same weights saved to a folder.

lora_pin keeps a reference to the tensors (on the CPU; tensors on a device are copied to it once) so that
it can read them again after a host-tier eviction, as it reads a folder again; the digest is checked on
that read, so tensors changed in place afterwards are refused rather than served.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_pin.errors import AdapterLoadError
from lora_pin.weights.config import AdapterConfig
from lora_pin.weights.limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_TENSORS, check_count
from lora_pin.weights.reader import AdapterFile

__all__ = ["AdapterTensors", "adapter_tensors"]

#: What messages name as the "file" of an adapter handed over in memory.
WHERE = "<tensors>"


@dataclass(frozen=True)
class AdapterTensors:
    """An adapter handed over in memory, checked for form (not yet against a model): its dense CPU
    ``tensors`` by PEFT name and its validated ``config``."""

    name: str
    tensors: dict[str, torch.Tensor]
    config: AdapterConfig

    def open(self) -> AdapterFile:
        """The adapter as an :class:`~lora_pin.weights.reader.AdapterFile` to load.

        Raises:
            AdapterLoadError: the LoRA tensors have mixed or non-float dtypes, or are not 2-D.
        """
        return AdapterFile.in_memory(self.name, self.config, self.tensors, where=WHERE)


def _plain(value: Any) -> Any:
    """``value`` as JSON would hold it: sets as sorted lists, tuples as lists, enums as their values."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _config_mapping(name: str, config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return _plain(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return _plain(dataclasses.asdict(config))
    raise AdapterLoadError(
        f"adapter {name!r} ({WHERE}): config must be a mapping (adapter_config.json's fields) or a PEFT "
        f"config object, got {type(config).__name__}"
    )


def adapter_tensors(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    config: Any,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
) -> AdapterTensors:
    """Check the form of an adapter handed over in memory, as a load from disk checks its files.

    Args:
        tensors: PEFT tensor names (``base_model.model.<module>.lora_A.weight`` ...) to dense tensors, as
            ``adapter_model.safetensors`` would hold them; tensors on a device are copied to the CPU.
        config: ``adapter_config.json``'s fields as a mapping, or a PEFT config object (``LoraConfig``).
        max_file_bytes, max_tensors: the limits a weight file is held to (see
            :mod:`lora_pin.weights.limits`): the tensors' bytes and count.

    Raises:
        AdapterLoadError: ``tensors`` is not a mapping of str to tensors, a tensor is sparse or on the meta
            device, there are more than ``max_tensors`` tensors or more than ``max_file_bytes`` bytes of
            them, or the config is refused (as :meth:`AdapterConfig.from_mapping`).
    """
    if not isinstance(tensors, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise AdapterLoadError(f"adapter {name!r} ({WHERE}): expected a mapping of tensor names to tensors")
    check_count(name, Path(WHERE), len(tensors), max_tensors)
    odd = sorted(k for k, v in tensors.items() if v.layout != torch.strided or v.device.type == "meta")
    if odd:
        raise AdapterLoadError(
            f"adapter {name!r} ({WHERE}): tensor(s) {odd[:4]} are not dense tensors with data "
            "(sparse or meta)"
        )
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    if total > max_file_bytes:
        raise AdapterLoadError(
            f"adapter {name!r} ({WHERE}): the tensors take {total} bytes, above the limit "
            f"max_file_bytes={max_file_bytes}"
        )
    parsed = AdapterConfig.from_mapping(name, WHERE, _config_mapping(name, config))
    # detach: a trainer's parameters would otherwise tie the host tier's copies to its autograd graph.
    held = {k: v.detach().to("cpu") for k, v in tensors.items()}
    return AdapterTensors(name, held, parsed)
