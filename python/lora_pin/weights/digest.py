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

The hash is BLAKE3 (256-bit, keyed by nothing): each tensor is hashed right after its bytes are read into
the host tier, while they are in cache, and the per-tensor digests are combined in name order. BLAKE3 rather
than SHA-256 because every served byte is hashed on every load: SHA-256 ran at 1.6 GB/s against BLAKE3's
3.0 GB/s on this project's 2-core runner, and the load path must stay near the cost of reading the file.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

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
    """The digests of one adapter's tensors, hashed on a background thread while the reader goes on reading
    (the hash of one tensor overlaps the read of the next; both release the GIL).

    :meth:`add` queues a tensor's bytes (kept alive until hashed: the caller must not write them
    meanwhile); :meth:`result` waits for every tensor queued and returns the digests by name.
    """

    _digests: dict[str, bytes] = field(default_factory=dict)
    _queued: int = 0
    _error: BaseException | None = None

    def add(self, name: str, dtype: str, shape: tuple[int, ...], data: Any) -> None:
        """Queue the digest of one tensor (see :func:`tensor_digest`)."""
        self._queued += 1
        _hasher().put((self, name, dtype, shape, data))

    def result(self) -> dict[str, bytes]:
        """Every queued tensor's digest, by name, once all are hashed.

        Raises:
            RuntimeError: hashing a tensor failed (the cause is chained).
        """
        if len(self._digests) < self._queued and self._error is None:
            done = threading.Event()
            _hasher().put((self, None, "", (), done))
            done.wait()
        if self._error is not None:
            raise RuntimeError("hashing an adapter's tensors failed") from self._error
        return self._digests


_QUEUE: queue.SimpleQueue[tuple[TensorDigests, str | None, str, tuple[int, ...], Any]] | None = None
_QUEUE_LOCK = threading.Lock()


def _hasher() -> queue.SimpleQueue[tuple[TensorDigests, str | None, str, tuple[int, ...], Any]]:
    """The queue of the one hashing thread (started on first use; a daemon, idle while nothing is loaded)."""
    global _QUEUE
    if _QUEUE is None:
        with _QUEUE_LOCK:
            if _QUEUE is None:
                jobs: queue.SimpleQueue[tuple[TensorDigests, str | None, str, tuple[int, ...], Any]]
                jobs = queue.SimpleQueue()
                threading.Thread(
                    target=_hash_forever, args=(jobs,), name="lora_pin-digest", daemon=True
                ).start()
                _QUEUE = jobs
    return _QUEUE


def _forget_hasher() -> None:
    # A forked child has the queue but not the thread: it starts its own on first use.
    global _QUEUE
    _QUEUE = None


os.register_at_fork(after_in_child=_forget_hasher)


def _hash_forever(
    jobs: queue.SimpleQueue[tuple[TensorDigests, str | None, str, tuple[int, ...], Any]],
) -> None:
    while True:
        # One call per job: the tensor and its owner are freed before the next wait, not held by an
        # idle thread (a daemon that frees them while the interpreter shuts down aborts the process).
        _hash_one(*jobs.get())


def _hash_one(owner: TensorDigests, name: str | None, dtype: str, shape: tuple[int, ...], data: Any) -> None:
    if name is None:
        data.set()  # every tensor the owner queued before this is hashed
        return
    try:
        owner._digests[name] = tensor_digest(name, dtype, shape, data)
    except BaseException as exc:  # reported to the owner's result(), never lost in this thread
        owner._error = exc


@dataclass(frozen=True)
class ServedModule:
    """One module an adapter serves: the model's target key, its rank and scaling, and its two tensors
    (three for a DoRA module: ``magnitude_name`` names its ``lora_magnitude_vector``)."""

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
