"""Build the SGMV kernels for an NVIDIA architecture ahead of time, with or without a GPU.

:func:`compile_launch` takes a :class:`~lora_pin.ops.triton_sgmv.KernelLaunch` (what the launchers would
run, built from real tensors so Triton specializes exactly as it would at launch: strides of 1 become
constants, 16-byte alignment and divisibility become attributes) and compiles it to a cubin for the
given compute capability through Triton's whole pipeline, ``ptxas`` included, without launching it. It
reports what decides whether the kernel can run and how many programs fit on a multiprocessor:
registers per thread, spilled bytes, and shared memory.

No GPU is needed: for the duration of the build Triton's active driver is swapped for one that only
names the target. That makes a CPU-only CI able to catch what would otherwise surface only on the first
launch on a GPU (a ``tl.dot`` shape the target refuses, a type error in one specialization, spills, or
more shared memory than the chip has). Not thread-safe: it changes Triton's process-wide driver while
it builds.
"""

from __future__ import annotations

import contextlib
import functools
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from lora_pin.ops.triton_sgmv import KernelLaunch

__all__ = ["MAX_SHARED_BYTES", "KernelBuild", "compile_launch", "resource_usage"]

# Shared memory one block may use (opt-in maximum), by compute capability.
MAX_SHARED_BYTES = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}

_WARP_SIZE = 32


@dataclass(frozen=True)
class KernelBuild:
    """One compiled specialization of a kernel and its resource use on the target."""

    name: str
    key: str  # Triton's hash of the source, specialization and options: equal keys, equal binaries
    arch: int
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    registers: int  # per thread
    local_bytes: int  # per thread: register spills (and any stack frame); 0 means none
    shared_bytes: int  # per block, dynamic (Triton's pipelining buffers) plus static

    @property
    def fits(self) -> bool:
        """No spills, and the shared memory is within the architecture's per-block limit."""
        limit = MAX_SHARED_BYTES.get(self.arch)
        return self.local_bytes == 0 and (limit is None or self.shared_bytes <= limit)


class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver while building: names the target, launches nothing."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def _target(arch: int) -> Iterator[None]:
    # DriverConfig keeps the active driver in `_active`; None means "create the default on next use",
    # which is what a process without a GPU must go back to (creating it here would raise).
    saved = driver._active
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, _WARP_SIZE)))
    try:
        yield
    finally:
        driver._active = saved


def compile_launch(launch: KernelLaunch, arch: int = 90) -> KernelBuild:
    """Compile ``launch``'s kernel, specialized for its arguments, to a cubin for ``sm_{arch}``.

    Tensors in ``launch.args`` may live on any device (their data pointers only decide alignment).

    Raises:
        triton.CompilationError: the kernel does not compile for this specialization and target.
        RuntimeError: Triton's ``ptxas`` or ``cuobjdump`` is missing.
    """
    # A fresh JITFunction: its per-device caches are bound to the target it first sees, so the one the
    # launchers use must never meet the compile-only driver.
    jitted = triton.jit(launch.kernel)
    with _target(arch):
        kernel = jitted.warmup(*launch.args, grid=launch.grid, **launch.constexprs)
    usage = resource_usage(kernel.asm["cubin"])
    meta = kernel.metadata
    constexprs = {k: v for k, v in launch.constexprs.items() if k.isupper()}
    return KernelBuild(
        name=meta.name,
        key=meta.hash,
        arch=arch,
        constexprs=constexprs,
        num_warps=meta.num_warps,
        num_stages=meta.num_stages,
        registers=usage["REG"],
        local_bytes=usage["LOCAL"] + usage["STACK"],
        shared_bytes=meta.shared + usage["SHARED"],
    )


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of a one-kernel cubin: REG, STACK, SHARED, LOCAL, ...

    Raises:
        RuntimeError: ``cuobjdump`` is missing or its output has no resource line.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", str(path)], check=True, capture_output=True, text=True
        ).stdout
    fields = dict(re.findall(r"\b([A-Z]+(?:\[\d+\])?):(\d+)", text))
    if "REG" not in fields:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return {k: int(v) for k, v in fields.items()}


@functools.cache
def _cuobjdump() -> str:
    return triton.knobs.nvidia.cuobjdump.path
