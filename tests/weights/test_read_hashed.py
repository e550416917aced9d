"""The core's read of a weight file's tensors (``_core._read_tensors``, what every host-tier load from disk
uses): the bytes land where they should and each digest equals the Python ``blake3`` path's
(:func:`~lora_pin.weights.digest.tensor_digest`), for every dtype, empty and odd shapes, tensors larger
than one read piece, and any number of threads; a short file or bad destinations are refused; the NaN/Inf
search it makes while reading refuses a bad weight as the slab check does."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin import _core
from lora_pin.errors import AdapterLoadError, UsageError
from lora_pin.weights import LoRATargets, load_adapter
from lora_pin.weights.digest import stored_dtype_name, tensor_bytes, tensor_digest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
# Empty, scalar, odd sizes, and one larger than the core's 256 KiB read piece at every element size.
SHAPES = [(), (0,), (3, 0), (1,), (7, 13), (2, 3, 5), (1, 1, 1, 1), (131_101,)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def cases() -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for shape in SHAPES:
            yield f"base_model.model.{dtype}.{'x'.join(map(str, shape))}.é", random_tensor(dtype, shape, gen)


@pytest.fixture(scope="module")
def weight_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, torch.Tensor, int]]]:
    path = tmp_path_factory.mktemp("read_hashed") / "tensors.bin"
    placed, offset = [], 5  # an odd start: offsets need no alignment
    with open(path, "wb") as f:
        f.write(b"\xff" * offset)
        for name, tensor in cases():
            data = bytes(tensor_bytes(tensor))
            f.write(data + b"\xaa" * 3)
            placed.append((name, tensor, offset))
            offset += len(data) + 3
    return path, placed


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_core_reads_and_hashes_as_the_python_path_does(
    weight_file: tuple[Path, list[tuple[str, torch.Tensor, int]]], threads: int
) -> None:
    path, placed = weight_file
    outs = [torch.full((t.nbytes,), 0x55, dtype=torch.uint8) for _, t, _ in placed]
    jobs = [
        (name, stored_dtype_name(t.dtype), tuple(t.shape), offset, out.data_ptr(), out.nbytes)
        for (name, t, offset), out in zip(placed, outs, strict=True)
    ]
    fd = os.open(path, os.O_RDONLY)
    try:
        digests, non_finite = _core._read_tensors(fd, jobs, threads=threads)
    finally:
        os.close(fd)
    assert len(digests) == 32 * len(placed)
    searched = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
    for i, ((name, tensor, _), out) in enumerate(zip(placed, outs, strict=True)):
        want = bytes(tensor_bytes(tensor))
        assert bytes(out.numpy().data) == want, name
        python = tensor_digest(name, stored_dtype_name(tensor.dtype), tuple(tensor.shape), want)
        assert digests[32 * i : 32 * i + 32] == python, name
        bad = int((~torch.isfinite(tensor)).sum()) if tensor.dtype in searched else None
        assert non_finite[i] == bad, name
    # Random bytes hold NaN/Inf in the larger float tensors: the search is tested, not vacuous.
    assert sum(n or 0 for n in non_finite) > 100
    assert len({digests[i : i + 32] for i in range(0, len(digests), 32)}) == len(placed)


# Byte counts on both sides of BLAKE3's chunk (1 KiB), of two chunks, and of the 16- and 64-chunk subtrees
# the core hashes on the library's wide path; the core reads tensors of up to 256 KiB together and hashes
# their chunks abreast across tensors, a larger one alone.
BOUNDARY_SIZES = [0, 1, 1023, 1024, 1025, 2048, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1]
BOUNDARY_SIZES += [64 * 1024 - 1, 64 * 1024, 64 * 1024 + 1, 256 * 1024, 256 * 1024 + 1]


@pytest.mark.parametrize("threads", [1, 2])
def test_digests_of_tensors_at_chunk_and_subtree_boundaries_are_blake3s(tmp_path: Path, threads: int) -> None:
    """Every size of ``BOUNDARY_SIZES``, with names that put the digest's head before a chunk boundary, on
    one, or past it (a head longer than a chunk), read in one call in an order that mixes sizes: each
    digest is the Python ``blake3`` package's (``tensor_digest``)."""
    gen = torch.Generator().manual_seed(1)
    # The head is 19 + 8 + len(name) + 8 + 2 + 8 + 8 bytes for a 1-D U8 tensor: 53 + len(name).
    names = ["w", "x" * (1024 - 53), "y" * (1024 - 52), "z" * 3000, "é" * 700]
    cases = [
        (f"{names[i % len(names)]}.{i}", size)
        for i, size in enumerate(BOUNDARY_SIZES + BOUNDARY_SIZES[::-1] + [17, 176 * 1024, 0, 3])
    ]
    datas = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _, size in cases]
    path = tmp_path / "boundaries.bin"
    path.write_bytes(b"".join(bytes(d.numpy().data) for d in datas))
    outs = [torch.zeros(size, dtype=torch.uint8) for _, size in cases]
    offsets = [0]
    for _, size in cases:
        offsets.append(offsets[-1] + size)
    jobs = [
        (name, "U8", (size,), offset, out.data_ptr(), size)
        for (name, size), offset, out in zip(cases, offsets, outs, strict=False)
    ]
    fd = os.open(path, os.O_RDONLY)
    try:
        digests, _ = _core._read_tensors(fd, jobs, threads=threads)
    finally:
        os.close(fd)
    for i, ((name, size), data, out) in enumerate(zip(cases, datas, outs, strict=True)):
        assert torch.equal(out, data), name
        want = tensor_digest(name, "U8", (size,), bytes(data.numpy().data))
        assert digests[32 * i : 32 * i + 32] == want, (name[:20], size)


def test_a_short_file_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    outs = [torch.empty(600_000, dtype=torch.uint8), torch.empty(600_000, dtype=torch.uint8)]
    jobs = [
        (name, "U8", (out.nbytes,), offset, out.data_ptr(), out.nbytes)
        for name, offset, out in (("whole", 0, outs[0]), ("cut", 600_000, outs[1]))
    ]
    fd = os.open(path, os.O_RDONLY)
    try:
        for threads in (1, 2):
            with pytest.raises(AdapterLoadError, match=r"tensor \"cut\": the file changed while it was read"):
                _core._read_tensors(fd, jobs, threads=threads)
    finally:
        os.close(fd)
    with pytest.raises(AdapterLoadError, match=r"tensor \"whole\": cannot read: .*Bad file descriptor"):
        _core._read_tensors(fd, jobs[:1])


def test_overlapping_or_null_destinations_are_refused_reading_nothing(tmp_path: Path) -> None:
    path = tmp_path / "some.bin"
    path.write_bytes(b"\x01" * 64)
    out = torch.zeros(64, dtype=torch.uint8)
    address = out.data_ptr()
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(UsageError, match='tensors "a" and "b" overlap'):
            _core._read_tensors(
                fd, [("a", "U8", (40,), 0, address, 40), ("b", "U8", (40,), 0, address + 24, 40)]
            )
        with pytest.raises(UsageError, match="null"):
            _core._read_tensors(fd, [("a", "U8", (4,), 0, 0, 4)])
    finally:
        os.close(fd)
    assert not out.any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_core_search_refuses_a_non_finite_weight_read_in_place(
    tmp_path: Path,
    make_adapters: Callable[..., dict[str, Path]],
    tiny_llama: torch.nn.Module,
    dtype: torch.dtype,
    value: float,
) -> None:
    """Stored in the serving dtype, every tensor is read straight into the host tier and searched by the
    core as it is read: a NaN or an infinity in any one of them is refused, naming that tensor, and the
    same adapter without it loads."""
    targets = LoRATargets.from_model(tiny_llama)
    source = make_adapters(tmp_path, {"a": dict(r=4, lora_alpha=8, target_modules=ALL, seed=3)})["a"]
    tensors = {k: v.to(dtype) for k, v in load_file(source / "adapter_model.safetensors").items()}
    save_file(tensors, source / "adapter_model.safetensors")
    load_adapter("a", source, targets, max_rank=8, dtype=dtype, pin_memory=False)
    for i, name in enumerate(sorted(tensors)[:: max(1, len(tensors) // 5)]):
        poisoned = dict(tensors)
        poisoned[name] = tensors[name].clone()
        poisoned[name].view(-1)[(7 * i) % poisoned[name].numel()] = value
        folder = tmp_path / f"bad{i}"
        shutil.copytree(source, folder)
        save_file(poisoned, folder / "adapter_model.safetensors")
        with pytest.raises(AdapterLoadError, match=rf"tensor '{re.escape(name)}' has 1 NaN/Inf value\(s\)"):
            load_adapter("a", folder, targets, max_rank=8, dtype=dtype, pin_memory=False)
