"""Finding an adapter on disk safely and reading its tensors.

Path containment: with ``allowed_roots``, the adapter path may not contain ``..`` and its folder and every
file read from it must lie inside one root. The folder is opened once and its files relative to it, without
following a symlink out of the roots (:mod:`lora_pin.weights.folder`), so a symlink swapped in during a
load cannot redirect a read.

Weights: the header of ``adapter_model.safetensors`` is parsed here and each tensor's bytes are read with
``pread`` from the descriptor the checks were made on (no memory map: a file truncated while it is read
gives a short read, refused, never SIGBUS). ``adapter_model.bin`` is a pickle (loading one from an
untrusted path runs arbitrary code) and is read only with ``allow_pickle=True``, then with
``torch.load(weights_only=True)`` from the same descriptor.

Untrusted files: the weight file's size and tensor count are checked against limits (see
:mod:`lora_pin.weights.limits`) before any tensor is read, and the file's identity (inode, size,
modification and change times; a writer can set the first back, not the second) is recorded so
:meth:`AdapterFile.check_unchanged` can refuse an adapter whose file was replaced or rewritten while its
tensors were being read.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import orjson
import torch

from lora_pin import _core
from lora_pin.errors import AdapterLoadError, PathNotAllowedError, UnsafeFormatError
from lora_pin.weights.config import AdapterConfig
from lora_pin.weights.digest import TensorDigests, stored_dtype_name, tensor_bytes
from lora_pin.weights.folder import AdapterFolder, FolderFile, path_within, real_roots, resolve_folder
from lora_pin.weights.limits import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_TENSORS,
    MAX_CONFIG_BYTES,
    check_count,
)

__all__ = [
    "PEFT_PREFIX",
    "AdapterFile",
    "LoraTensorPair",
    "adapter_dir_for_name",
    "open_adapter",
    "path_within",
    "read_adapter_config",
    "read_contained_config",
    "resolve_adapter_dir",
]

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
#: The prefix of every tensor name PEFT saves (before the module key).
PEFT_PREFIX = "base_model.model."
# The safetensors format's own cap on its JSON header.
_MAX_HEADER_BYTES = 100_000_000
#: The most threads one load reads and hashes its tensors on (the caller's included; the core keeps a
#: small adapter on one): reading from the page cache and hashing both scale with cores.
READ_THREADS = min(
    4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)


def resolve_adapter_dir(
    name: str, path: str | os.PathLike[str], allowed_roots: Iterable[str | os.PathLike[str]] | None = None
) -> Path:
    """The real path of adapter directory ``path``, checked against ``allowed_roots`` when given.

    Raises:
        PathNotAllowedError: ``path`` has a ``..`` component, or its real path is outside every root.
        AdapterLoadError: ``path`` is not a directory.
    """
    return resolve_folder(name, path, real_roots(allowed_roots))


def adapter_dir_for_name(root: str | os.PathLike[str], name: str) -> Path | None:
    """The folder of adapter ``name`` under ``root`` (``root/name``; a name may be nested, ``org/style``),
    or None when there is no such folder. The real path is checked to stay inside ``root``; the adapter is
    then read with :func:`open_adapter` confined to ``root``.

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
    """The tensor names and shapes of one module's ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``);
    for an embedding (``embedding``), its ``lora_embedding_A`` (``[r, num_embeddings]``) and
    ``lora_embedding_B`` (``[embedding_dim, r]``). A DoRA module also has its ``lora_magnitude_vector``
    (``magnitude_name``, shape ``magnitude_shape``, ``[out]`` for a linear); None for plain LoRA."""

    module_key: str
    a_name: str
    b_name: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    embedding: bool = False
    magnitude_name: str | None = None
    magnitude_shape: tuple[int, ...] | None = None


class _Stored(NamedTuple):
    """Where one tensor's bytes lie in a safetensors file (offsets from the file's start)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class AdapterFile:
    """An opened adapter: its config, its weight file (open) and the LoRA pairs found in it, not yet read.

    ``pairs`` maps module keys (relative to the base model) to tensor names; ``unused`` lists every tensor
    name that is not a complete ``lora_A``/``lora_B`` pair. Tensors are read on demand with :meth:`tensor`.
    ``digests`` holds the digest (:func:`~lora_pin.weights.digest.tensor_digest`) of every tensor read
    with :meth:`read_into`, :meth:`read_many`, :meth:`read_slice_into` or ``tensor(..., record=True)``,
    hashed from the bytes as they were read (by the core, piece by piece as they land, for a weight
    file's tensors). Close it (or use ``with``) when
    done: it holds the folder's and the weight file's descriptors (none for tensors handed over in memory,
    :meth:`in_memory`).
    """

    name: str
    directory: Path
    config: AdapterConfig
    weights_path: Path
    dtype: torch.dtype
    pairs: dict[str, LoraTensorPair]
    unused: list[str]
    _folder: AdapterFolder | None = field(repr=False)
    _weights: FolderFile | None = field(repr=False)
    _stored: dict[str, _Stored] = field(default_factory=dict, repr=False)
    _loaded: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    digests: TensorDigests = field(default_factory=TensorDigests, repr=False)
    #: The config file's and the weight file's header bytes, exactly as read (a safetensors file only):
    #: everything but the tensors' bytes that a load's checks and layout depend on, so a loader may
    #: reuse the work of an earlier load with the same key.
    layout_key: tuple[bytes, bytes] | None = field(default=None, repr=False)

    @classmethod
    def in_memory(
        cls, name: str, config: AdapterConfig, tensors: dict[str, torch.Tensor], *, where: str = "<tensors>"
    ) -> AdapterFile:
        """An adapter handed over as ``tensors`` (PEFT tensor names -> dense CPU tensors) and ``config``,
        read as a weight file's tensors are (``where`` stands for the file in messages).

        Raises:
            AdapterLoadError: the LoRA tensors have mixed or non-float dtypes, or are not 2-D.
        """
        path = Path(where)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        dtypes: dict[str, torch.dtype | str] = {k: v.dtype for k, v in tensors.items()}
        pairs, unused, dtype = _pair_tensors(name, path, shapes, dtypes)
        return cls(name, path, config, path, dtype, pairs, unused, None, None, {}, tensors)

    def tensor(self, tensor_name: str, *, record: bool = False) -> torch.Tensor:
        """One stored tensor, as stored (dtype and shape of the file), in fresh CPU memory; with ``record``
        its digest goes into :attr:`digests`.

        Raises:
            AdapterLoadError: the file ended before the tensor's last byte (truncated while it was read).
        """
        if self._loaded is not None:
            loaded = self._loaded[tensor_name]
            if record:
                self._record(tensor_name, loaded)
            return loaded
        stored = self._stored[tensor_name]
        raw = torch.empty(stored.end - stored.begin, dtype=torch.uint8)
        if record:
            self._read_hashed([(tensor_name, stored, raw)])
        else:
            _pread_into(self, raw.numpy().data, stored.begin)
        return raw.view(_SAFETENSORS_DTYPES[stored.dtype]).view(stored.shape)

    def standalone_digest(self) -> str:
        """The digest a manager gives this adapter (:mod:`lora_pin.weights.digest`), without a model: every
        pair serves the module it names, at its tensors' rank (what a load checks against the model).
        Reads (and hashes) every LoRA tensor not read yet."""
        from lora_pin.weights.digest import ServedModule, adapter_digest

        served = []
        for key, pair in self.pairs.items():
            for name in (pair.a_name, pair.b_name, pair.magnitude_name):
                if name is not None:
                    self.tensor(name, record=True)
            rank = pair.a_shape[0]
            scaling = self.config.scaling_for(key, rank)
            served.append(ServedModule(key, rank, scaling, pair.a_name, pair.b_name, pair.magnitude_name))
        return adapter_digest(self.digests.result(), served)

    def _record(self, tensor_name: str, tensor: torch.Tensor) -> None:
        self.digests.add(
            tensor_name, stored_dtype_name(tensor.dtype), tuple(tensor.shape), tensor_bytes(tensor)
        )

    def read_into(self, tensor_name: str, out: torch.Tensor) -> None:
        """Put stored tensor ``tensor_name`` into ``out`` (same shape), converting to ``out``'s dtype.

        When the file holds it in ``out``'s dtype and ``out`` is a contiguous CPU tensor, its bytes are
        read from the file straight into ``out`` (one copy); otherwise it is read into fresh memory and
        copied over. Its digest goes into :attr:`digests`, hashed from the bytes as they were read.

        Raises:
            AdapterLoadError: the file ended before the tensor's last byte (truncated while it was read).
        """
        self.read_many([(tensor_name, out)])

    def read_many(self, reads: Sequence[tuple[str, torch.Tensor]]) -> list[int | None]:
        """:meth:`read_into` for each ``(tensor_name, out)`` of ``reads``, all from one call into the core;
        returns per read the number of NaN/Inf values the core found in what it put into ``out``, or
        None where it did not search (a tensor converted to ``out``'s dtype, a dtype other than
        float64/32/16 and bfloat16, or tensors handed over in memory).

        The core reads every tensor in pieces and hashes and searches each piece as it lands (the bytes
        cross memory once), sharing the tensors out over :data:`READ_THREADS` threads with the GIL
        released. ``out`` tensors must not overlap. When it fails, the ``out`` tensors read so far may
        hold new bytes.

        Raises:
            AdapterLoadError: a tensor's bytes could not be read (naming it): the file ended before its
                last byte (truncated while it was read), or an I/O error.
        """
        if self._loaded is not None:
            for tensor_name, out in reads:
                out.copy_(self.tensor(tensor_name, record=True))
            return [None] * len(reads)
        jobs: list[tuple[str, _Stored, torch.Tensor]] = []
        converted: list[tuple[int, torch.Tensor, torch.Tensor, _Stored]] = []
        for tensor_name, out in reads:
            stored = self._stored[tensor_name]
            if (
                _SAFETENSORS_DTYPES[stored.dtype] == out.dtype
                and out.device.type == "cpu"
                and out.is_contiguous()
                and tuple(out.shape) == stored.shape
            ):
                jobs.append((tensor_name, stored, out))
            else:
                raw = torch.empty(stored.end - stored.begin, dtype=torch.uint8)
                converted.append((len(jobs), out, raw, stored))
                jobs.append((tensor_name, stored, raw))
        non_finite = self._read_hashed(jobs)
        for i, out, raw, stored in converted:
            out.copy_(raw.view(_SAFETENSORS_DTYPES[stored.dtype]).view(stored.shape))
            non_finite[i] = None
        return non_finite

    def read_at(
        self, reads: Sequence[tuple[str, str, tuple[int, ...], int, int, int]], base: int
    ) -> list[int | None]:
        """Read tensors as :meth:`read_many` does, into memory given by address: each read is
        ``(tensor_name, stored_dtype, shape, file_offset, byte_offset, nbytes)`` as this file's header
        gives them, and its bytes go to ``base + byte_offset`` (``base``: the address of a live contiguous
        CPU tensor that holds every destination; destinations must not overlap). Returns the core's
        NaN/Inf count of each read (None for dtypes it does not search).

        Raises:
            AdapterLoadError: as :meth:`read_many`.
        """
        assert self._weights is not None
        try:
            digests, non_finite = _core._read_tensors(
                self._weights.fd,
                [(n, d, shape, at, base + to, size) for n, d, shape, at, to, size in reads],
                threads=READ_THREADS,
            )
        except AdapterLoadError as exc:
            raise AdapterLoadError(f"adapter {self.name!r} ({self.weights_path}): {exc}") from None
        for i, read in enumerate(reads):
            self.digests.put(read[0], digests[32 * i : 32 * i + 32])
        return non_finite

    def stored(self, tensor_name: str) -> tuple[str, tuple[int, ...], int, int]:
        """Where stored tensor ``tensor_name`` lies in the weight file: ``(dtype, shape, begin, end)``,
        its safetensors dtype name, shape, and byte range from the file's start.

        Raises:
            KeyError: the file has no such tensor, or the adapter was not read from a safetensors file.
        """
        return self._stored[tensor_name]

    def _read_hashed(self, jobs: list[tuple[str, _Stored, torch.Tensor]]) -> list[int | None]:
        """Read each stored tensor's bytes into its tensor (contiguous, on the CPU, exactly the stored
        bytes long: the core writes ``out.nbytes`` bytes at ``out.data_ptr()``) and record its digest;
        return the core's NaN/Inf count of each (see :meth:`read_many`)."""
        assert self._weights is not None
        try:
            digests, non_finite = _core._read_tensors(
                self._weights.fd,
                [(name, s.dtype, s.shape, s.begin, out.data_ptr(), out.nbytes) for name, s, out in jobs],
                threads=READ_THREADS,
            )
        except AdapterLoadError as exc:
            raise AdapterLoadError(f"adapter {self.name!r} ({self.weights_path}): {exc}") from None
        for i, (name, _, _) in enumerate(jobs):
            self.digests.put(name, digests[32 * i : 32 * i + 32])
        return non_finite

    def read_slice_into(
        self, tensor_name: str, out: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]
    ) -> None:
        """Put rows ``[rows)`` and columns ``[cols)`` of 2-D stored tensor ``tensor_name`` into ``out``
        (shape ``[rows, cols]``), converting to ``out``'s dtype.

        The whole tensor is read (one contiguous read) and hashed into :attr:`digests`, then the part
        copied: a tensor-parallel rank that keeps only its shard still knows the whole adapter's digest,
        which the ranks compare before they register it (reading the whole of a column range costs less
        than one read per row of it would).

        Raises:
            AdapterLoadError: the file ended before a byte read (truncated while it was read).
            ValueError: the ranges fall outside the tensor or do not match ``out``'s shape.
        """
        (r0, r1), (c0, c1) = rows, cols
        shape = (
            self._loaded[tensor_name].shape if self._loaded is not None else self._stored[tensor_name].shape
        )
        height, width = shape
        if not (0 <= r0 <= r1 <= height and 0 <= c0 <= c1 <= width) or tuple(out.shape) != (r1 - r0, c1 - c0):
            raise ValueError(
                f"slice rows {rows} cols {cols} of {tensor_name!r} {list(shape)} into {list(out.shape)}"
            )
        whole = self.tensor(tensor_name, record=True)
        if out.numel():
            out.copy_(whole[r0:r1, c0:c1])

    def check_unchanged(self) -> None:
        """Refuse the adapter if its weight file was replaced or rewritten since it was opened.

        Call it after every tensor was copied out: what was read then came from one version of the file.

        Raises:
            AdapterLoadError: the file's inode, size, modification or change time differs from when it
                was opened (on its descriptor or under its name), or it is gone.
        """
        if self._folder is not None and self._weights is not None:
            self._folder.check_unchanged(self._weights)

    @property
    def file_bytes(self) -> int:
        """Bytes of the LoRA tensors in the file (A and B of every pair, and a DoRA pair's magnitude, at
        the pairs' stored dtype)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(
            (_numel(p.a_shape) + _numel(p.b_shape) + _numel(p.magnitude_shape or (0,))) * size
            for p in self.pairs.values()
        )

    def close(self) -> None:
        """Close the weight file and the folder (idempotent); :meth:`tensor` cannot read afterwards."""
        if self._folder is not None:
            self._folder.close()

    def __enter__(self) -> AdapterFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _pread_into(file: AdapterFile, out: memoryview, offset: int) -> None:
    done = 0
    while done < len(out):
        try:
            assert file._weights is not None
            got = os.preadv(file._weights.fd, [out[done:]], offset + done)
        except OSError as exc:
            raise AdapterLoadError(
                f"adapter {file.name!r} ({file.weights_path}): cannot read: {exc}"
            ) from None
        if got == 0:
            raise AdapterLoadError(
                f"adapter {file.name!r} ({file.weights_path}): the file changed while it was read (it ends "
                f"at byte {offset + done}, before the tensor's end at {offset + len(out)})"
            )
        done += got


def _read_upto(fd: int, count: int) -> bytes:
    chunks, total = [], 0
    while total < count:
        chunk = os.pread(fd, count - total, total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _read_config(folder: AdapterFolder) -> AdapterConfig:
    """The folder's ``adapter_config.json``, read from its descriptor and validated."""
    return _read_config_and_bytes(folder)[0]


def _read_config_and_bytes(folder: AdapterFolder) -> tuple[AdapterConfig, bytes]:
    """:func:`_read_config`, and the file's bytes as read."""
    name = folder.name
    file = folder.open_file(CONFIG_NAME, limit=MAX_CONFIG_BYTES, what="MAX_CONFIG_BYTES")
    if file is None:
        raise AdapterLoadError(
            f"adapter {name!r}: {folder.path / CONFIG_NAME} does not exist; not a PEFT adapter directory"
        )
    try:
        raw = _read_upto(file.fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise AdapterLoadError(f"adapter {name!r} ({file.path}): cannot read the config: {exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        # The file grew after it was measured: still never read more than the limit.
        raise AdapterLoadError(
            f"adapter {name!r} ({file.path}): file is above the limit MAX_CONFIG_BYTES={MAX_CONFIG_BYTES}"
        )
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise AdapterLoadError(f"adapter {name!r} ({file.path}): not valid JSON: {exc}") from None
    return AdapterConfig.from_mapping(name, str(file.path), data), raw


def read_contained_config(
    name: str, path: str | os.PathLike[str], allowed_roots: Iterable[str | os.PathLike[str]] | None = None
) -> AdapterConfig:
    """The config of the adapter at ``path``, read as :func:`open_adapter` reads it (the folder and
    ``adapter_config.json`` confined to ``allowed_roots`` by construction).

    Raises:
        PathNotAllowedError: the folder or the config resolves outside every root.
        AdapterLoadError: the config is missing, not a regular file, above
            :data:`~lora_pin.weights.limits.MAX_CONFIG_BYTES`, not JSON or refused (see
            :meth:`~lora_pin.weights.config.AdapterConfig.from_mapping`).
    """
    with AdapterFolder.open(name, path, real_roots(allowed_roots)) as folder:
        return _read_config(folder)


def read_adapter_config(name: str, directory: str | os.PathLike[str]) -> AdapterConfig:
    """Read and validate ``directory / "adapter_config.json"`` (:func:`read_contained_config` with no
    allowed roots: the same descriptor-relative read).

    Raises:
        AdapterLoadError: as :func:`read_contained_config`.
    """
    return read_contained_config(name, directory)


def _header_error(name: str, file: FolderFile, why: str) -> AdapterLoadError:
    return AdapterLoadError(f"adapter {name!r} ({file.path}): cannot read safetensors: {why}")


def _read_header(name: str, file: FolderFile) -> bytes:
    """The weight file's first ``8 + length`` bytes: the header's length and its JSON."""
    size = file.stamp[1]
    try:
        prefix = os.pread(file.fd, 8, 0)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if length < 0 or length > _MAX_HEADER_BYTES or 8 + length > size:
            raise _header_error(name, file, f"header length {length} does not fit the file's {size} bytes")
        return _read_upto(file.fd, 8 + length)
    except OSError as exc:
        raise _header_error(name, file, str(exc)) from None


def _index_safetensors(
    name: str, file: FolderFile, raw: bytes, max_tensors: int
) -> tuple[dict[str, _Stored], dict[str, LoraTensorPair], list[str], torch.dtype]:
    """Every tensor's dtype, shape and byte range from the header ``raw`` (:func:`_read_header`),
    checked by the core as the safetensors format requires (known dtype, byte length = elements x
    element size, ranges back to back covering the data), and the LoRA pairs among them (see
    :func:`_pair_tensors`)."""
    try:
        count, tensors, found, unused = _core._index_header(raw[8:], len(raw), file.stamp[1], max_tensors)
    except ValueError as exc:
        raise _header_error(name, file, str(exc)) from None
    check_count(name, file.path, count, max_tensors)
    stored = {t[0]: _Stored(t[1], tuple(t[2]), t[3], t[4]) for t in tensors}
    names = [t[0] for t in tensors]
    shapes = [s.shape for s in stored.values()]
    dtypes: list[torch.dtype | str] = [_SAFETENSORS_DTYPES.get(t[1], t[1]) for t in tensors]
    pairs, dtype = _checked_pairs(name, file.path, names, shapes, dtypes, found)
    return stored, pairs, [names[i] for i in unused], dtype


def _load_pickle(name: str, file: FolderFile, max_tensors: int) -> dict[str, torch.Tensor]:
    try:
        with open(file.fd, "rb", closefd=False) as handle:
            state = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises UnpicklingError, RuntimeError, OSError ...
        raise AdapterLoadError(
            f"adapter {name!r} ({file.path}): cannot load with weights_only: {exc}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise AdapterLoadError(f"adapter {name!r} ({file.path}): expected a dict of tensors")
    odd = [k for k, v in state.items() if v.layout != torch.strided or v.device.type != "cpu"]
    if odd:
        raise AdapterLoadError(
            f"adapter {name!r} ({file.path}): tensor(s) {sorted(map(str, odd))[:4]} are not dense "
            "CPU tensors (sparse, meta or on a device)"
        )
    check_count(name, file.path, len(state), max_tensors)
    # detach: an nn.Parameter (what saving a module's parameters gives) or a tensor requiring grad
    # would make the host tier's copies part of an autograd graph.
    return {str(k): v.detach() for k, v in state.items()}


def _pair_tensors(
    name: str, where: Path, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype | str]
) -> tuple[dict[str, LoraTensorPair], list[str], torch.dtype]:
    """The complete lora_A/lora_B pairs by module key, the unused tensor names, and the pairs' dtype.

    The core finds the pairs by PEFT's names (:func:`lora_pin._core._lora_pairs`): every LoRA tensor
    under the prefix, a linear's ``lora_A.weight``/``lora_B.weight`` or an embedding's
    ``lora_embedding_A``/``_B``, never the two kinds mixed, and a DoRA ``lora_magnitude_vector`` beside
    either; any other tensor is unused (refused by the checks against the model).

    Raises:
        AdapterLoadError: a pair's A or B is not 2-D, the pairs' dtypes differ or are not float.
    """
    names = list(shapes)
    try:
        found, unused = _core._lora_pairs([(n, shapes[n]) for n in names])
    except ValueError as exc:
        raise AdapterLoadError(f"adapter {name!r} ({where}): {exc}") from None
    pairs, dtype = _checked_pairs(
        name, where, names, list(shapes.values()), [dtypes[n] for n in names], found
    )
    return pairs, [names[i] for i in unused], dtype


def _checked_pairs(
    name: str,
    where: Path,
    names: list[str],
    shapes: list[tuple[int, ...]],
    dtypes: list[torch.dtype | str],
    found: list[tuple[str, int, int, bool, int | None]],
) -> tuple[dict[str, LoraTensorPair], torch.dtype]:
    """The core's pairs (indexes into ``names``, ``shapes`` and ``dtypes``) as :class:`LoraTensorPair`
    by module key, and their dtype, checked: one float dtype for every A and B, a float magnitude."""
    pairs = {
        module_key: LoraTensorPair(
            module_key,
            names[a],
            names[b],
            shapes[a],
            shapes[b],
            embedding,
            None if m is None else names[m],
            None if m is None else shapes[m],
        )
        for module_key, a, b, embedding, m in found
    }
    pair_dtypes = {dtypes[i] for _, a, b, _, _ in found for i in (a, b)}
    if len(pair_dtypes) > 1:
        raise AdapterLoadError(
            f"adapter {name!r} ({where}): LoRA tensors have mixed dtypes {sorted(map(str, pair_dtypes))}"
        )
    dtype = pair_dtypes.pop() if pair_dtypes else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise AdapterLoadError(f"adapter {name!r} ({where}): LoRA tensors have non-float dtype {dtype}")
    # A magnitude may be stored in another float dtype than A and B (it is applied in float32).
    for *_, m in found:
        m_dtype = None if m is None else dtypes[m]
        if m_dtype is not None and not (isinstance(m_dtype, torch.dtype) and m_dtype.is_floating_point):
            raise AdapterLoadError(
                f"adapter {name!r} ({where}): tensor {names[m]!r} has non-float dtype {m_dtype}"
            )
    return pairs, dtype


def open_adapter(
    name: str,
    path: str | os.PathLike[str],
    *,
    allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
    allow_pickle: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
) -> AdapterFile:
    """Open, read the config of and index the weights of the adapter at ``path``; no tensor is read yet.

    The result holds open descriptors: close it (``with open_adapter(...) as file:``).

    Raises:
        PathNotAllowedError: the directory or a file in it resolves outside ``allowed_roots``.
        UnsafeFormatError: only ``adapter_model.bin`` exists and ``allow_pickle`` is False.
        AdapterLoadError: the config is refused, there is no weight file, a file is not a regular file or
            cannot be read, the weight file is larger than ``max_file_bytes``, holds more than
            ``max_tensors`` tensors or is not valid safetensors, tensors have mixed dtypes or are not 2-D.
    """
    folder = AdapterFolder.open(name, path, real_roots(allowed_roots))
    try:
        config, raw_config = _read_config_and_bytes(folder)
        return _open_weights(folder, config, raw_config, allow_pickle, max_file_bytes, max_tensors)
    except BaseException:
        folder.close()
        raise


def _open_weights(
    folder: AdapterFolder,
    config: AdapterConfig,
    raw_config: bytes,
    allow_pickle: bool,
    max_file_bytes: int,
    max_tensors: int,
) -> AdapterFile:
    name = folder.name
    stored: dict[str, _Stored] = {}
    loaded: dict[str, torch.Tensor] | None = None
    file = folder.open_file(SAFETENSORS_NAME, limit=max_file_bytes, what="max_file_bytes")
    if file is not None:
        header = _read_header(name, file)
        indexed = _INDEXED.get((header, file.stamp[1]))
        if indexed is None:
            stored, pairs, unused, dtype = _index_safetensors(name, file, header, max_tensors)
            _INDEXED.put((header, file.stamp[1]), (stored, pairs, unused, dtype))
        else:
            stored, pairs, unused, dtype = indexed
            check_count(name, file.path, len(stored), max_tensors)
        # Copies: the cached index is shared, an AdapterFile's own.
        return AdapterFile(
            name,
            folder.path,
            config,
            file.path,
            dtype,
            dict(pairs),
            list(unused),
            folder,
            file,
            dict(stored),
            None,
            layout_key=(raw_config, header),
        )
    elif allow_pickle:
        file = folder.open_file(PICKLE_NAME, limit=max_file_bytes, what="max_file_bytes")
        if file is None:
            raise AdapterLoadError(
                f"adapter {name!r} ({folder.path}): no {SAFETENSORS_NAME} (or {PICKLE_NAME}) found"
            )
        loaded = _load_pickle(name, file, max_tensors)
        shapes = {k: tuple(v.shape) for k, v in loaded.items()}
        dtypes: dict[str, torch.dtype | str] = {k: v.dtype for k, v in loaded.items()}
    elif os.path.lexists(folder.path / PICKLE_NAME):
        raise UnsafeFormatError(
            f"adapter {name!r} ({folder.path / PICKLE_NAME}): weights are a pickle (adapter_model.bin); "
            "unpickling a file from an untrusted path can run arbitrary code. Convert it to "
            "adapter_model.safetensors or pass allow_pickle=True to load it with "
            "torch.load(weights_only=True)"
        )
    else:
        raise AdapterLoadError(
            f"adapter {name!r} ({folder.path}): no {SAFETENSORS_NAME} (or {PICKLE_NAME}) found"
        )
    pairs, unused, dtype = _pair_tensors(name, file.path, shapes, dtypes)
    return AdapterFile(
        name, folder.path, config, file.path, dtype, pairs, unused, folder, file, stored, loaded
    )


class _IndexCache:
    """The last few weight files' indexes and tensor pairs (:func:`_index_safetensors`,
    :func:`_pair_tensors`), by the header's bytes and the file's size, which decide them: adapters
    trained alike share one header, and indexing and pairing it is most of what opening one costs.
    Only what passed every check is kept (an error names its own adapter and file); headers above
    :data:`_CACHED_HEADER_BYTES` are not kept."""

    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._held: dict[
            tuple[bytes, int], tuple[dict[str, _Stored], dict[str, LoraTensorPair], list[str], torch.dtype]
        ] = {}
        self._lock = threading.Lock()

    def get(
        self, key: tuple[bytes, int]
    ) -> tuple[dict[str, _Stored], dict[str, LoraTensorPair], list[str], torch.dtype] | None:
        with self._lock:
            found = self._held.pop(key, None)
            if found is not None:
                self._held[key] = found
            return found

    def put(
        self,
        key: tuple[bytes, int],
        value: tuple[dict[str, _Stored], dict[str, LoraTensorPair], list[str], torch.dtype],
    ) -> None:
        if len(key[0]) > _CACHED_HEADER_BYTES:
            return
        with self._lock:
            self._held[key] = value
            while len(self._held) > self._entries:
                del self._held[next(iter(self._held))]


#: The largest safetensors header :class:`_IndexCache` keeps (an adapter of a few thousand tensors).
_CACHED_HEADER_BYTES = 1 << 20
_INDEXED = _IndexCache(32)


# The float dtypes of the safetensors format, as torch names them.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
