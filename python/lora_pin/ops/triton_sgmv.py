"""SGMV kernels in Triton: multi-adapter shrink and expand driven by segment arrays.

One program per (segment, slice, block): it reads its segment's slot and the slot's rank for the slice
from device memory and exits at once for slot ``-1``, a rank of 0, or a block past the rank (shrink) or
the slice width (expand). The rank is also the bound of every weight load, so a rank-8 adapter in a
rank-64 pool reads 8 rows. Shrink splits the long ``in`` dimension across programs (fp32 atomics into a
workspace) when segments alone would leave the GPU idle; expand fuses the scaling and the add into
``out`` and covers every slice of a fused layer (q/k/v, gate/up) in one launch. The launchers read
shapes only, never tensor contents, so a CUDA graph can capture them.

The kernels are kept as plain functions and wrapped twice: ``triton.jit`` for CUDA and the Triton
interpreter for CPU tensors (tests), so the interpreter needs no ``TRITON_INTERPRET`` in the
environment and never changes how ``triton.jit`` behaves for anyone else in the process. For that they
call only ``triton.language`` builtins, none of its ``@jit`` helpers (``tl.cdiv``, ``tl.zeros``, ...),
which were compiled-mode functions when ``triton`` was imported.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from lora_pin.ops._checks import (
    MAX_SLICES,
    OpArgumentError,
    check_expand_args,
    check_segment_contents,
    check_shrink_args,
)
from lora_pin.ops.segments import KernelMeta

__all__ = [
    "KernelLaunch",
    "expand_launch",
    "sgmv_expand",
    "sgmv_shrink",
    "shrink_launch",
    "shrink_split_k",
]


def _sgmv_shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [slots, n_slices * R, in]
    v_ptr,  # [T, n_slices * R]: v's dtype, or fp32 when SPLIT_K > 1 (atomics)
    perm_ptr,  # int64 [N]
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]
    slot_ranks_ptr,  # int32 [slots, n_slices]
    in_features,
    max_rank,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_vt,
    stride_vr,
    N_SLICES: tl.constexpr,
    RANK_BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slice_idx = tl.program_id(1) // RANK_BLOCKS
    r_start = (tl.program_id(1) % RANK_BLOCKS) * BLOCK_R
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    rank = tl.minimum(tl.load(slot_ranks_ptr + slot * N_SLICES + slice_idx), max_rank)
    if r_start >= rank:
        return
    seg_lo = tl.load(seg_indptr_ptr + seg)
    seg_hi = tl.load(seg_indptr_ptr + seg + 1)

    k_per_split = ((in_features + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K)) * BLOCK_K
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    offs_r = r_start + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    cols = slice_idx * max_rank + offs_r
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + cols[:, None] * stride_ar  # [BLOCK_R, 1]
    offs_k = tl.arange(0, BLOCK_K)

    for m_lo in range(seg_lo, seg_hi, BLOCK_M):
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_hi
        tokens = tl.load(perm_ptr + offs_m, mask=m_mask, other=0)
        x_rows = x_ptr + tokens[:, None] * stride_xt  # [BLOCK_M, 1]
        acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            ks = k + offs_k
            k_mask = ks < k_hi
            x_tile = tl.load(
                x_rows + ks[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            a_tile = tl.load(
                a_rows + ks[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :], other=0.0
            )
            acc += tl.dot(x_tile, tl.trans(a_tile), input_precision=DOT_PRECISION)
        v_ptrs = v_ptr + tokens[:, None] * stride_vt + cols[None, :] * stride_vr
        mask = m_mask[:, None] & r_mask[None, :]
        if SPLIT_K == 1:
            tl.store(v_ptrs, acc.to(v_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(v_ptrs, acc, mask=mask)


def _sgmv_expand_kernel(
    out_ptr,  # [T, out_total], read and written in place
    v_ptr,  # [T, n_slices * R]
    b_ptr,  # [slots, out_total, R]
    perm_ptr,  # int64 [N]
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]
    slot_ranks_ptr,  # int32 [slots, n_slices]
    slot_scalings_ptr,  # float32 [slots, n_slices]
    max_rank,
    stride_ot,
    stride_on,
    stride_vt,
    stride_vr,
    stride_bs,
    stride_bn,
    stride_br,
    # slice_offsets as scalars (unused ones repeat out_total): no device copy of a host list.
    off0,
    off1,
    off2,
    off3,
    off4,
    off5,
    off6,
    off7,
    off8,
    N_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slice_idx = tl.program_id(1)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    rank = tl.minimum(tl.load(slot_ranks_ptr + slot * N_SLICES + slice_idx), max_rank)
    if rank <= 0:
        return
    col_lo = tl.where(
        slice_idx == 0,
        off0,
        tl.where(
            slice_idx == 1,
            off1,
            tl.where(
                slice_idx == 2,
                off2,
                tl.where(
                    slice_idx == 3,
                    off3,
                    tl.where(
                        slice_idx == 4,
                        off4,
                        tl.where(slice_idx == 5, off5, tl.where(slice_idx == 6, off6, off7)),
                    ),
                ),
            ),
        ),
    )
    col_hi = tl.where(
        slice_idx == 0,
        off1,
        tl.where(
            slice_idx == 1,
            off2,
            tl.where(
                slice_idx == 2,
                off3,
                tl.where(
                    slice_idx == 3,
                    off4,
                    tl.where(
                        slice_idx == 4,
                        off5,
                        tl.where(slice_idx == 5, off6, tl.where(slice_idx == 6, off7, off8)),
                    ),
                ),
            ),
        ),
    )
    n_start = col_lo + tl.program_id(2) * BLOCK_N
    if n_start >= col_hi:
        return
    seg_lo = tl.load(seg_indptr_ptr + seg)
    seg_hi = tl.load(seg_indptr_ptr + seg + 1)
    scaling = tl.load(slot_scalings_ptr + slot * N_SLICES + slice_idx)

    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_hi
    offs_r = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn  # [BLOCK_N, 1]
    v_col0 = slice_idx * max_rank

    for m_lo in range(seg_lo, seg_hi, BLOCK_M):
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_hi
        tokens = tl.load(perm_ptr + offs_m, mask=m_mask, other=0)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for r in range(0, rank, BLOCK_R):
            rs = r + offs_r
            r_mask = rs < rank
            v_tile = tl.load(
                v_ptr + tokens[:, None] * stride_vt + (v_col0 + rs)[None, :] * stride_vr,
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            b_tile = tl.load(
                b_rows + rs[None, :] * stride_br, mask=n_mask[:, None] & r_mask[None, :], other=0.0
            )
            acc += tl.dot(v_tile, tl.trans(b_tile), input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + tokens[:, None] * stride_ot + offs_n[None, :] * stride_on
        mask = m_mask[:, None] & n_mask[None, :]
        base = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (base.to(tl.float32) + scaling * acc).to(out_ptr.dtype.element_ty), mask=mask)


_COMPILED: dict[Callable[..., None], Any] = {}

# Triton 3.9 warns when FMA contraction is left to its changing default; ask for it (today's default).
_COMPILE_OPTIONS = {"enable_fp_fusion": True}


@functools.cache
def _interpreted(kernel: Callable[..., None]) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel)


def _launchable(kernel: Callable[..., None], interpret: bool) -> Any:
    """The kernel as a launchable object (``kernel[grid](...)``), compiled or interpreted."""
    if interpret:
        return _interpreted(kernel)
    if kernel not in _COMPILED:
        _COMPILED[kernel] = triton.jit(kernel)
    return _COMPILED[kernel]


def _use_interpreter(
    device: torch.device,
    interpret: bool | None,
    dtype: torch.dtype,
    meta: KernelMeta,
    n_tokens: int,
    max_rank: int,
) -> bool:
    if interpret is None:
        interpret = device.type != "cuda"
    if not interpret and device.type != "cuda":
        raise ValueError(f"compiled Triton kernels need CUDA tensors, got {device}; pass interpret=True")
    if interpret:
        # The interpreter indexes host memory with whatever the arrays hold, and has no bf16 arithmetic.
        if dtype == torch.bfloat16:
            raise OpArgumentError("the Triton interpreter computes bf16 wrongly; use fp16 or fp32 there")
        check_segment_contents(
            meta.perm,
            meta.seg_indptr.tolist(),
            meta.seg_slots.tolist(),
            meta.ranks().tolist(),
            n_tokens,
            max_rank,
        )
    return interpret


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 follows torch's own TF32 switch for matmuls (off by default).
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _block_r(max_rank: int) -> int:
    return 16 if max_rank <= 16 else 32 if max_rank <= 32 else 64


def _shrink_block_k(dtype: torch.dtype, block_r: int, interpret: bool) -> int:
    if interpret:
        return 32
    return 64 if dtype == torch.float32 or block_r == 64 else 128


def _expand_block_n(dtype: torch.dtype, max_rank: int, block_m: int) -> int:
    # Register use decides it (tests/ops/test_triton_aot.py builds every choice made here for sm_90):
    # fp32 multiplies on the FMA units with its tiles in registers, and wider tiles spill (16 x 64
    # spilled 8 B under Triton 3.6, 16 x 128 24 B under 3.9); in fp16/bf16 a 64 x 128 tile takes 228
    # registers a thread, two blocks a multiprocessor, too few loads in flight for a kernel that
    # streams ``out``.
    if dtype == torch.float32:
        return 32
    return 128 if max_rank <= 32 and block_m <= 32 else 64


def _block_m(n_rows: int, n_segments: int) -> int:
    # Shapes only (no data read): the mean segment length picks the row tile.
    mean = n_rows // max(n_segments, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch, fully described: what :func:`sgmv_shrink` / :func:`sgmv_expand` run.

    ``kernel`` is the plain kernel function (wrap it with ``triton.jit`` or the interpreter), ``grid`` the
    program grid, ``args`` the positional arguments and ``constexprs`` the compile-time ones (with the
    compile options). Built from shapes and strides only, never tensor contents.
    """

    kernel: Callable[..., None]
    grid: tuple[int, int, int]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]

    def run(self, *, interpret: bool) -> None:
        """Launch it: compiled for CUDA tensors, or under the Triton interpreter for CPU tensors (the
        interpreter runs any tile configuration, so GPU launches can be checked on a CPU)."""
        _launchable(self.kernel, interpret)[self.grid](*self.args, **self.constexprs)


def shrink_launch(
    x: torch.Tensor,
    a: torch.Tensor,
    v: torch.Tensor,
    meta: KernelMeta,
    max_rank: int,
    split_k: int,
    *,
    interpret: bool,
) -> KernelLaunch:
    """The shrink kernel's launch writing ``v`` (fp32 when ``split_k > 1``); arguments already checked."""
    n_slices, seg_slots = meta.n_slices, meta.seg_slots.contiguous()
    in_features = x.shape[1]
    block_r = _block_r(max_rank)
    rank_blocks = triton.cdiv(max_rank, block_r)
    return KernelLaunch(
        _sgmv_shrink_kernel,
        (seg_slots.shape[0], n_slices * rank_blocks, split_k),
        (
            x,
            a,
            v,
            meta.perm.contiguous(),
            meta.seg_indptr.contiguous(),
            seg_slots,
            meta.ranks().contiguous(),
            in_features,
            max_rank,
            x.stride(0),
            x.stride(1),
            a.stride(0),
            a.stride(1),
            a.stride(2),
            v.stride(0),
            v.stride(1),
        ),
        {
            "N_SLICES": n_slices,
            "RANK_BLOCKS": rank_blocks,
            "SPLIT_K": split_k,
            "BLOCK_M": 16 if interpret else _block_m(meta.perm.shape[0], seg_slots.shape[0]),
            "BLOCK_R": block_r,
            "BLOCK_K": _shrink_block_k(x.dtype, block_r, interpret),
            "DOT_PRECISION": _dot_precision(x.dtype),
            **_COMPILE_OPTIONS,
        },
    )


def shrink_split_k(
    in_features: int,
    n_segments: int,
    n_slices: int,
    max_rank: int,
    dtype: torch.dtype,
    target_programs: int,
    *,
    interpret: bool = False,
) -> int:
    """Programs per segment along ``in``: doubled (up to 16) while the grid has fewer than
    ``target_programs`` programs and each split keeps at least four ``BLOCK_K`` tiles."""
    block_r = _block_r(max_rank)
    block_k = _shrink_block_k(dtype, block_r, interpret)
    programs = max(n_segments * n_slices * triton.cdiv(max_rank, block_r), 1)
    split_k = 1
    while split_k < 16 and programs * split_k < target_programs and in_features >= 4 * block_k * split_k:
        split_k *= 2
    return split_k


def expand_launch(
    out: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    meta: KernelMeta,
    max_rank: int,
    *,
    interpret: bool,
) -> KernelLaunch:
    """The expand kernel's launch; arguments already checked."""
    slot_scalings, slice_offsets = meta.expand_layout()
    seg_slots = meta.seg_slots.contiguous()
    n_slices = len(slice_offsets) - 1
    max_width = max(hi - lo for lo, hi in itertools.pairwise(slice_offsets))
    block_m = 16 if interpret else _block_m(meta.perm.shape[0], seg_slots.shape[0])
    block_n = 32 if interpret else _expand_block_n(out.dtype, max_rank, block_m)
    offsets = [*slice_offsets] + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    return KernelLaunch(
        _sgmv_expand_kernel,
        (seg_slots.shape[0], n_slices, triton.cdiv(max_width, block_n)),
        (
            out,
            v,
            b,
            meta.perm.contiguous(),
            meta.seg_indptr.contiguous(),
            seg_slots,
            meta.ranks().contiguous(),
            slot_scalings.contiguous(),
            max_rank,
            out.stride(0),
            out.stride(1),
            v.stride(0),
            v.stride(1),
            b.stride(0),
            b.stride(1),
            b.stride(2),
            *offsets,
        ),
        {
            "N_SLICES": n_slices,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_R": _block_r(max_rank),
            "DOT_PRECISION": _dot_precision(out.dtype),
            **_COMPILE_OPTIONS,
        },
    )


def sgmv_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    meta: KernelMeta,
    *,
    split_k: int | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Triton :func:`lora_pin.ops.shrink`: returns ``v`` ``[T, n_slices * R]`` in ``x.dtype``.

    Args:
        split_k: programs per segment along ``in`` (fp32 atomics); ``None`` picks from the shapes.
        interpret: run under the Triton interpreter (CPU tensors); ``None`` means "unless on CUDA".

    Raises:
        OpArgumentError: a shape, dtype or device mismatch (see ``check_shrink_args``); under the
            interpreter also bad segment contents, or bf16.
        ValueError: ``interpret=False`` with CPU tensors.
    """
    max_rank = check_shrink_args(x, a, meta)
    interpret = _use_interpreter(x.device, interpret, x.dtype, meta, x.shape[0], max_rank)
    n_tokens, in_features = x.shape
    n_slices, n_segments = meta.n_slices, meta.seg_slots.shape[0]
    if split_k is None:
        # Two waves of programs over the GPU's multiprocessors; a few under the interpreter.
        target = 4 if interpret else 2 * _sm_count(x.device.index or 0)
        split_k = shrink_split_k(
            in_features, n_segments, n_slices, max_rank, x.dtype, target, interpret=interpret
        )
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")

    # Rows no segment covers stay zero, as do the columns past each slice's rank.
    v = x.new_zeros(n_tokens, n_slices * max_rank, dtype=torch.float32 if split_k > 1 else x.dtype)
    if n_segments == 0 or n_tokens == 0 or max_rank == 0:
        return v.to(x.dtype)
    launch = shrink_launch(x, a, v, meta, max_rank, split_k, interpret=interpret)
    launch.run(interpret=interpret)
    return v.to(x.dtype)


def sgmv_expand(
    out: torch.Tensor,  # [T, out_total], updated in place
    v: torch.Tensor,  # [T, n_slices * R]
    b: torch.Tensor,  # [slots, out_total, R]
    meta: KernelMeta,
    *,
    interpret: bool | None = None,
) -> None:
    """Triton :func:`lora_pin.ops.expand`: ``out[rows, slice] += scaling * v @ bᵀ``, in place.

    Args:
        interpret: run under the Triton interpreter (CPU tensors); ``None`` means "unless on CUDA".

    Raises:
        OpArgumentError: a shape, dtype or device mismatch (see ``check_expand_args``); under the
            interpreter also bad segment contents, or bf16.
        ValueError: ``interpret=False`` with CPU tensors.
    """
    max_rank = check_expand_args(out, v, b, meta)
    interpret = _use_interpreter(out.device, interpret, out.dtype, meta, out.shape[0], max_rank)
    _, slice_offsets = meta.expand_layout()
    max_width = max(hi - lo for lo, hi in itertools.pairwise(slice_offsets))
    if meta.seg_slots.shape[0] == 0 or out.shape[0] == 0 or max_rank == 0 or max_width == 0:
        return
    launch = expand_launch(out, v, b, meta, max_rank, interpret=interpret)
    launch.run(interpret=interpret)
