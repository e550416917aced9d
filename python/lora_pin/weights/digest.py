"""The content digest of an adapter: one hash of everything that decides its outputs.

An engine keys its caches (KV prefix blocks, sampled outputs) by this digest, so it must change exactly when
what is served changes. It covers:

* every served tensor as read (before any conversion to the serving dtype): its name, its stored dtype
  (the safetensors name: ``F32``, ``BF16`` ...), its shape and its bytes;
* per served module (a target key of the model): its rank, its scaling (``lora_alpha / r``, rsLoRA,
  ``alpha_pattern``) and which two tensors serve it (``target_parameters`` decides that for MoE experts),
  and for a DoRA module its ``lora_magnitude_vector`` (the factor computed from it and the base weight is
  not hashed: the base model is the cache's own key).

It leaves out what cannot change an output: the file's layout and header order, ``__metadata__``, config
fields that only describe (``base_model_name_or_path``), and PEFT's copies of base weights, which are checked
equal to the model's. So the same weights give one digest from two folders, from ``adapter_model.bin`` or
safetensors, from a load of tensors in memory, on every tensor-parallel rank and in every process.

The hash is BLAKE3 (256-bit, keyed by nothing): each tensor is hashed as its bytes are read into the host
tier, piece by piece while they are in cache (by the native kernels, ``rust/kernels/src/weights.rs``, in the
layout of :func:`tensor_digest`), and the per-tensor digests are combined in name order. BLAKE3 rather than
SHA-256 because every served byte is hashed on every load: SHA-256 ran at 1.6 GB/s against BLAKE3's 3.0 GB/s
on this project's 2-core runner, and the load path must stay near the cost of reading the file.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from blake3 import blake3

__all__ = [
    "DIGEST_ALGORITHM",
    "ServedModule",
    "TensorDigests",
    "adapter_digest",
    "stored_dtype_name",
    "tensor_bytes",
    "tensor_digest",
]

#: The hash behind every digest (its hex form is 64 characters).
DIGEST_ALGORITHM = "blake3"
# A new layout of what is hashed gets a new tag, so digests of two layouts never collide.
_ADAPTER_TAG = b"lora_pin adapter digest v1\0"
_TENSOR_TAG = b"lora_pin tensor v1\0"

# torch dtype -> the safetensors name, so a tensor read from either format hashes alike.
_STORED_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def stored_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``torch.float32`` -> ``"F32"``).

    Raises:
        ValueError: safetensors has no name for it (complex, quantized ...).
    """
    try:
        return _STORED_NAMES[dtype]
    except KeyError:
        raise ValueError(f"no safetensors dtype name for {dtype}") from None


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def tensor_digest(name: str, dtype: str, shape: tuple[int, ...], data: Any) -> bytes:
    """The 32-byte digest of one stored tensor: its name, safetensors dtype name, shape and ``data`` (a
    buffer of its bytes, C order, little endian, as the file holds them). Releases the GIL while hashing.
    """
    hasher = blake3(_TENSOR_TAG)
    hasher.update(_text(name) + _text(dtype) + struct.pack(f"<Q{len(shape)}Q", len(shape), *shape))
    hasher.update(data)
    return hasher.digest()


def tensor_bytes(tensor: torch.Tensor) -> Any:
    """A buffer of ``tensor``'s bytes in C order (a CPU tensor's own memory when it is contiguous)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


@dataclass
class TensorDigests:
    """The digests of one adapter's tensors, by name, as the reader records them.

    A weight file's tensors are hashed by the core while it reads them (:meth:`put`); tensors handed
    over in memory or unpickled are hashed here (:meth:`add`, with the GIL released while hashing).
    """

    _digests: dict[str, bytes] = field(default_factory=dict)

    def add(self, name: str, dtype: str, shape: tuple[int, ...], data: Any) -> None:
        """Hash one tensor (see :func:`tensor_digest`) and record its digest."""
        self._digests[name] = tensor_digest(name, dtype, shape, data)

    def put(self, name: str, digest: bytes) -> None:
        """Record the 32-byte ``digest`` of tensor ``name``, hashed elsewhere in the layout of
        :func:`tensor_digest`."""
        self._digests[name] = digest

    def result(self) -> dict[str, bytes]:
        """Every recorded tensor's digest, by name."""
        return self._digests


class ServedModule(NamedTuple):
    """One module an adapter serves: the model's target key, its rank and scaling, and its two tensors
    (three for a DoRA module: ``magnitude_name`` names its ``lora_magnitude_vector``). A tuple, not a
    dataclass: a first load makes one per module it serves."""

    key: str
    rank: int
    scaling: float
    a_name: str
    b_name: str
    magnitude_name: str | None = None


def adapter_digest(tensors: Mapping[str, bytes], served: Iterable[ServedModule]) -> str:
    """The adapter's digest, 64 hex characters, from the digests of its served tensors (by name) and its
    served modules (in any order: they are sorted by key).

    Raises:
        KeyError: a served module names a tensor with no digest.
    """
    hasher = blake3(_ADAPTER_TAG)
    for module in sorted(served, key=lambda m: m.key):
        # A DoRA module's record is marked in its key (a module key holds no NUL) and ends with its
        # magnitude's digest, so a plain LoRA module's record, and so its digest, is as before.
        dora = module.magnitude_name is not None
        hasher.update(
            _text(module.key + "\0dora" if dora else module.key)
            + struct.pack("<Qd", module.rank, module.scaling)
            + tensors[module.a_name]
            + tensors[module.b_name]
            + (tensors[module.magnitude_name] if module.magnitude_name is not None else b"")
        )
    return hasher.hexdigest()
