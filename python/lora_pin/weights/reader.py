"""Finding an adapter on disk safely and reading its tensors.

Path containment: with ``allowed_roots``, the adapter path may not contain ``..`` and its real path (and the
real path of every file read from it) must lie inside the real path of one root, so a symlink pointing out of
the root is refused. Weights: ``adapter_model.safetensors`` is memory-mapped with ``safe_open`` and only the
tensors needed are materialised; ``adapter_model.bin`` is a pickle (loading one from an untrusted path runs
arbitrary code) and is read only with ``allow_pickle=True``, then with ``torch.load(weights_only=True)``.

Untrusted files: the weight file's size and tensor count are checked against limits (see
:mod:`lora_pin.weights.limits`) before any tensor is read, and the file's identity (inode, size,
modification and change times; a writer can set the first back, not the second) is recorded so
:meth:`AdapterFile.check_unchanged` can refuse an adapter whose file was replaced or rewritten while its
tensors were being read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lora_pin.errors import AdapterLoadError, PathNotAllowedError, UnsafeFormatError
from lora_pin.weights.config import AdapterConfig, read_adapter_config
from lora_pin.weights.limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_TENSORS, check_count, check_file_size

__all__ = [
    "AdapterFile",
    "LoraTensorPair",
    "adapter_dir_for_name",
    "open_adapter",
    "path_within",
    "read_contained_config",
    "resolve_adapter_dir",
]

SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "a", ".lora_B.weight": "b"}


def path_within(real: str, roots: list[str]) -> bool:
    """Whether real path ``real`` is one of ``roots`` (real paths) or lies inside one."""
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def resolve_adapter_dir(
    name: str, path: str | os.PathLike[str], allowed_roots: Iterable[str | os.PathLike[str]] | None = None
) -> Path:
    """The real path of adapter directory ``path``, checked against ``allowed_roots`` when given.

    Raises:
        PathNotAllowedError: ``path`` has a ``..`` component, or its real path is outside every root.
        AdapterLoadError: ``path`` is not a directory.
    """
    raw = os.fspath(path)
    real = os.path.realpath(raw)
    if allowed_roots is not None:
        roots = [os.path.realpath(os.fspath(r)) for r in allowed_roots]
        if ".." in Path(raw).parts:
            raise PathNotAllowedError(
                f"adapter {name!r}: path {raw!r} contains '..'; refused under allowed_roots"
            )
        if not path_within(real, roots):
            raise PathNotAllowedError(
                f"adapter {name!r}: path {raw!r} resolves to {real!r}, outside every allowed root {roots}"
            )
    if not os.path.isdir(real):
        raise AdapterLoadError(
            f"adapter {name!r}: {raw!r} is not a directory (expected a PEFT adapter directory)"
        )
    return Path(real)


def adapter_dir_for_name(root: str | os.PathLike[str], name: str) -> Path | None:
    """The folder of adapter ``name`` under ``root`` (``root/name``; a name may be nested, ``org/style``),
    or None when there is no such folder. The real path is checked to stay inside ``root``.

    Raises:
        PathNotAllowedError: ``name`` is empty, absolute, has an empty, ``.`` or ``..`` component, a
            backslash or a NUL; or ``root/name`` resolves (through a symlink) outside ``root``.
        AdapterLoadError: ``root/name`` exists but is not a directory.
    """
    parts = name.split("/")
    if (
        not name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise PathNotAllowedError(
            f"adapter {name!r}: not usable as a folder name under {os.fspath(root)!r} (one or more "
            "'/'-separated components, none empty, '.' or '..', no backslash or NUL)"
        )
    path = Path(root, *parts)
    if not os.path.lexists(path):
        return None
    return resolve_adapter_dir(name, path, [root])


@dataclass(frozen=True)
class LoraTensorPair:
    """The tensor names and shapes of one module's ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``)."""

    module_key: str
    a_name: str
    b_name: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


@dataclass
class AdapterFile:
    """An opened adapter: its config, its weight file and the LoRA pairs found in it, not yet read.

    ``pairs`` maps module keys (relative to the base model) to tensor names; ``unused`` lists every tensor
    name that is not a complete ``lora_A``/``lora_B`` pair. Tensors are read on demand with :meth:`tensor`.
    """

    name: str
    directory: Path
    config: AdapterConfig
    weights_path: Path
    dtype: torch.dtype
    pairs: dict[str, LoraTensorPair]
    unused: list[str]
    _safetensors: Any = field(default=None, repr=False)
    _loaded: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _stamp: tuple[int, int, int, int] | None = field(default=None, repr=False)

    def tensor(self, tensor_name: str) -> torch.Tensor:
        """One stored tensor, as stored (dtype and layout of the file)."""
        if self._loaded is not None:
            return self._loaded[tensor_name]
        return self._safetensors.get_tensor(tensor_name)

    def check_unchanged(self) -> None:
        """Refuse the adapter if its weight file was replaced or rewritten since it was opened.

        Call it after every tensor was copied out: what was read then came from one version of the file.

        Raises:
            AdapterLoadError: the file's inode, size, modification or change time differs from when it
                was opened, or it is gone.
        """
        try:
            now = _stamp(self.weights_path)
        except OSError as exc:
            raise AdapterLoadError(
                f"adapter {self.name!r} ({self.weights_path}): the file vanished while it was read: {exc}"
            ) from None
        if now != self._stamp:
            raise AdapterLoadError(
                f"adapter {self.name!r} ({self.weights_path}): the file changed while it was read "
                f"(inode, size, mtime_ns, ctime_ns {self._stamp} -> {now}); write adapters elsewhere and "
                "rename them into place"
            )

    @property
    def file_bytes(self) -> int:
        """Bytes of the LoRA tensors in the file (A and B of every pair, at the stored dtype)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum((_numel(p.a_shape) + _numel(p.b_shape)) * size for p in self.pairs.values())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _stamp(path: Path) -> tuple[int, int, int, int]:
    stat = os.stat(path)
    # ctime as well: a writer can put mtime back (os.utime), but not the change time.
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def _checked_file(name: str, path: Path, roots: list[str] | None) -> Path:
    real = os.path.realpath(path)
    if roots is not None and not path_within(real, roots):
        raise PathNotAllowedError(
            f"adapter {name!r}: {path} resolves to {real!r}, outside every allowed root {roots}"
        )
    return Path(real)


def read_contained_config(
    name: str, path: str | os.PathLike[str], allowed_roots: Iterable[str | os.PathLike[str]] | None = None
) -> AdapterConfig:
    """The config of the adapter at ``path``, its folder and ``adapter_config.json`` both checked against
    ``allowed_roots`` (as :func:`open_adapter` checks them) before a byte is read.

    Raises:
        PathNotAllowedError: the folder or the config resolves outside every root.
        AdapterLoadError: as :func:`~lora_pin.weights.config.read_adapter_config`.
    """
    roots = None if allowed_roots is None else [os.path.realpath(os.fspath(r)) for r in allowed_roots]
    directory = resolve_adapter_dir(name, path, roots)
    _checked_file(name, directory / "adapter_config.json", roots)
    return read_adapter_config(name, directory)


def open_adapter(
    name: str,
    path: str | os.PathLike[str],
    *,
    allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
    allow_pickle: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
) -> AdapterFile:
    """Resolve, read the config of and index the weights of the adapter at ``path``; no tensor is read yet.

    Raises:
        PathNotAllowedError: the directory or a file in it resolves outside ``allowed_roots``.
        UnsafeFormatError: only ``adapter_model.bin`` exists and ``allow_pickle`` is False.
        AdapterLoadError: the config is refused, there is no weight file, the file cannot be read, is larger
            than ``max_file_bytes`` or holds more than ``max_tensors`` tensors, tensors have mixed dtypes or
            are not 2-D.
    """
    roots = None if allowed_roots is None else [os.path.realpath(os.fspath(r)) for r in allowed_roots]
    directory = resolve_adapter_dir(name, path, roots)
    _checked_file(name, directory / "adapter_config.json", roots)
    config = read_adapter_config(name, directory)

    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype | str] = {}
    handle: Any = None
    loaded: dict[str, torch.Tensor] | None = None
    safetensors_path = directory / SAFETENSORS_NAME
    pickle_path = directory / PICKLE_NAME
    if safetensors_path.exists():
        weights_path = _checked_file(name, safetensors_path, roots)
        check_file_size(name, weights_path, max_file_bytes, "max_file_bytes")
        try:
            stamp = _stamp(weights_path)
            handle = safe_open(str(weights_path), framework="pt")
            keys = handle.keys()
            check_count(name, weights_path, len(keys), max_tensors)
            for key in keys:
                tensor_slice = handle.get_slice(key)
                shapes[key] = tuple(tensor_slice.get_shape())
                stored = tensor_slice.get_dtype()
                dtypes[key] = _SAFETENSORS_DTYPES.get(stored, stored)
        except AdapterLoadError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError and OSErrors
            raise AdapterLoadError(
                f"adapter {name!r} ({weights_path}): cannot read safetensors: {exc}"
            ) from None
    elif pickle_path.exists():
        weights_path = _checked_file(name, pickle_path, roots)
        if not allow_pickle:
            raise UnsafeFormatError(
                f"adapter {name!r} ({weights_path}): weights are a pickle (adapter_model.bin); unpickling a "
                "file from an untrusted path can run arbitrary code. Convert it to adapter_model.safetensors "
                "or pass allow_pickle=True to load it with torch.load(weights_only=True)"
            )
        check_file_size(name, weights_path, max_file_bytes, "max_file_bytes")
        try:
            stamp = _stamp(weights_path)
            state = torch.load(str(weights_path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch.load raises UnpicklingError, RuntimeError, OSError ...
            raise AdapterLoadError(
                f"adapter {name!r} ({weights_path}): cannot load with weights_only: {exc}"
            ) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise AdapterLoadError(f"adapter {name!r} ({weights_path}): expected a dict of tensors")
        odd = [k for k, v in state.items() if v.layout != torch.strided or v.device.type != "cpu"]
        if odd:
            raise AdapterLoadError(
                f"adapter {name!r} ({weights_path}): tensor(s) {sorted(map(str, odd))[:4]} are not dense "
                "CPU tensors (sparse, meta or on a device)"
            )
        check_count(name, weights_path, len(state), max_tensors)
        loaded = {str(k): v for k, v in state.items()}
        shapes = {k: tuple(v.shape) for k, v in loaded.items()}
        dtypes = {k: v.dtype for k, v in loaded.items()}
    else:
        raise AdapterLoadError(
            f"adapter {name!r} ({directory}): no {SAFETENSORS_NAME} (or {PICKLE_NAME}) found"
        )

    halves: dict[str, dict[str, str]] = {}
    unused: list[str] = []
    for key in shapes:
        for suffix, half in _SUFFIXES.items():
            # PEFT saves every LoRA tensor under the prefix and loads nothing without it: a tensor
            # without it is unused (refused), never a second copy of a module's half.
            if key.endswith(suffix) and key.startswith(_PREFIX):
                module_key = key[len(_PREFIX) : -len(suffix)]
                halves.setdefault(module_key, {})[half] = key
                break
        else:
            unused.append(key)
    pairs: dict[str, LoraTensorPair] = {}
    for module_key, found in halves.items():
        if set(found) != {"a", "b"}:
            unused.extend(found.values())
            continue
        a_shape, b_shape = shapes[found["a"]], shapes[found["b"]]
        for tensor_name, shape in ((found["a"], a_shape), (found["b"], b_shape)):
            if len(shape) != 2:
                raise AdapterLoadError(
                    f"adapter {name!r} ({weights_path}): tensor {tensor_name!r} has shape {list(shape)}, "
                    "expected 2-D"
                )
        pairs[module_key] = LoraTensorPair(module_key, found["a"], found["b"], a_shape, b_shape)
    pair_dtypes = {dtypes[n] for p in pairs.values() for n in (p.a_name, p.b_name)}
    if len(pair_dtypes) > 1:
        raise AdapterLoadError(
            f"adapter {name!r} ({weights_path}): LoRA tensors have mixed dtypes "
            f"{sorted(map(str, pair_dtypes))}"
        )
    dtype = pair_dtypes.pop() if pair_dtypes else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise AdapterLoadError(
            f"adapter {name!r} ({weights_path}): LoRA tensors have non-float dtype {dtype}"
        )
    return AdapterFile(
        name, directory, config, weights_path, dtype, pairs, sorted(unused), handle, loaded, stamp
    )


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
