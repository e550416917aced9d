"""SGMV kernels in Triton on a paged pool (:mod:`lora_pin.ops.paged`): shrink and expand reading A and
B through each slot's page table.

They are :mod:`lora_pin.ops.triton_sgmv`'s kernels with one change: a rank's address is its page's
base pointer (``page_table[page_indptr[slot] + r // page_rank]``) plus its row in the page, instead of
the slot's base plus ``r``. Each row of a rank block looks its page up (a small int32 gather, shared by
every ``in`` / ``out`` tile of the block), so the rank block ``BLOCK_R`` stays what the slot kernels
use (16, 32 or 64: ``tl.dot`` needs at least 16, and S-LoRA's and SGLang's page of 8 ranks is smaller)
and may span pages. Shrink splits ``in`` across programs (fp32 atomics) when segments alone would
leave the GPU idle, as the slot kernel does. Per-slot rank skipping is kept: a program exits for slot
``-1``, a rank of 0 or a block past the rank, and the rank bounds every weight load, so a rank-8
adapter reads one page of 8.
The rank is also capped by the ranks the slot's pages hold, so no program reads past its page table.
The launchers read shapes only, never tensor contents (a CUDA graph can capture them); under the
interpreter (CPU tensors) the segment and page contents are checked first, as the interpreter indexes
host memory with whatever they hold.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from lora_pin.ops._checks import MAX_SLICES, OpArgumentError, check_segment_contents
from lora_pin.ops.paged import (
    PageTable,
    check_page_contents,
    check_paged_expand_args,
    check_paged_shrink_args,
)
from lora_pin.ops.segments import KernelMeta
from lora_pin.ops.triton_sgmv import (
    KernelLaunch,
    _block_m,
    _block_r,
    _dot_precision,
    _expand_block_n,
    _shrink_block_k,
    _sm_count,
    shrink_split_k,
)

__all__ = ["paged_expand", "paged_expand_launch", "paged_shrink", "paged_shrink_launch"]


def _paged_shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [num_pages, n_slices * PAGE_RANK, in]
    v_ptr,  # [T, n_slices * R]: v's dtype, or fp32 when SPLIT_K > 1 (atomics)
    perm_ptr,  # int64 [N]
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]
    slot_ranks_ptr,  # int32 [slots, n_slices]
    page_indptr_ptr,  # int32 [slots + 1]
    page_table_ptr,  # int32 [P]
    in_features,
    max_rank,
    stride_xt,
    stride_xk,
    stride_ap,
    stride_ar,
    stride_ak,
    stride_vt,
    stride_vr,
    N_SLICES: tl.constexpr,
    PAGE_RANK: tl.constexpr,
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
    page_lo = tl.load(page_indptr_ptr + slot)
    held = (tl.load(page_indptr_ptr + slot + 1) - page_lo) * PAGE_RANK
    rank = tl.minimum(tl.minimum(tl.load(slot_ranks_ptr + slot * N_SLICES + slice_idx), max_rank), held)
    if r_start >= rank:
        return
    seg_lo = tl.load(seg_indptr_ptr + seg)
    seg_hi = tl.load(seg_indptr_ptr + seg + 1)

    k_per_split = ((in_features + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K)) * BLOCK_K
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    offs_r = r_start + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    pages = tl.load(page_table_ptr + page_lo + offs_r // PAGE_RANK, mask=r_mask, other=0)
    rows = slice_idx * PAGE_RANK + offs_r % PAGE_RANK
    a_rows = a_ptr + pages.to(tl.int64)[:, None] * stride_ap + rows[:, None] * stride_ar  # [BLOCK_R, 1]
    cols = slice_idx * max_rank + offs_r
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


def _paged_expand_kernel(
    out_ptr,  # [T, out_total], read and written in place
    v_ptr,  # [T, n_slices * R]
    b_ptr,  # [num_pages, out_total, PAGE_RANK]
    perm_ptr,  # int64 [N]
    seg_indptr_ptr,  # int32 [S + 1]
    seg_slots_ptr,  # int32 [S]
    slot_ranks_ptr,  # int32 [slots, n_slices]
    slot_scalings_ptr,  # float32 [slots, n_slices]
    page_indptr_ptr,  # int32 [slots + 1]
    page_table_ptr,  # int32 [P]
    max_rank,
    stride_ot,
    stride_on,
    stride_vt,
    stride_vr,
    stride_bp,
    stride_bn,
    stride_br,
    # slice_offsets as scalars (unused ones repeat out_total), as in triton_sgmv: no device copy.
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
    PAGE_RANK: tl.constexpr,
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
    page_lo = tl.load(page_indptr_ptr + slot)
    held = (tl.load(page_indptr_ptr + slot + 1) - page_lo) * PAGE_RANK
    rank = tl.minimum(tl.minimum(tl.load(slot_ranks_ptr + slot * N_SLICES + slice_idx), max_rank), held)
    if rank <= 0:
        return
    # A kernel may call no helper (see triton_sgmv's docstring), so the offsets are chosen inline.
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
    b_rows = b_ptr + offs_n[:, None] * stride_bn  # [BLOCK_N, 1]
    v_col0 = slice_idx * max_rank

    for m_lo in range(seg_lo, seg_hi, BLOCK_M):
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_hi
        tokens = tl.load(perm_ptr + offs_m, mask=m_mask, other=0)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for r in range(0, rank, BLOCK_R):
            rs = r + offs_r
            r_mask = rs < rank
            pages = tl.load(page_table_ptr + page_lo + rs // PAGE_RANK, mask=r_mask, other=0)
            v_tile = tl.load(
                v_ptr + tokens[:, None] * stride_vt + (v_col0 + rs)[None, :] * stride_vr,
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            b_tile = tl.load(
                b_rows + pages.to(tl.int64)[None, :] * stride_bp + (rs % PAGE_RANK)[None, :] * stride_br,
                mask=n_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            acc += tl.dot(v_tile, tl.trans(b_tile), input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + tokens[:, None] * stride_ot + offs_n[None, :] * stride_on
        mask = m_mask[:, None] & n_mask[None, :]
        base = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (base.to(tl.float32) + scaling * acc).to(out_ptr.dtype.element_ty), mask=mask)


def _interpret(device: torch.device, interpret: bool | None, dtype: torch.dtype) -> bool:
    if interpret is None:
        interpret = device.type != "cuda"
    if not interpret and device.type != "cuda":
        raise ValueError(f"compiled Triton kernels need CUDA tensors, got {device}; pass interpret=True")
    if interpret and dtype == torch.bfloat16:
        raise OpArgumentError("the Triton interpreter computes bf16 wrongly; use fp16 or fp32 there")
    return interpret


def _check_contents(meta: KernelMeta, pages: PageTable, n_tokens: int, max_rank: int, num_pages: int) -> None:
    ranks = meta.ranks().tolist()
    check_segment_contents(
        meta.perm, meta.seg_indptr.tolist(), meta.seg_slots.tolist(), ranks, n_tokens, max_rank
    )
    check_page_contents(pages, ranks, num_pages)


def paged_shrink(
    x: torch.Tensor,
    a_pages: torch.Tensor,
    pages: PageTable,
    meta: KernelMeta,
    max_rank: int,
    *,
    split_k: int | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """:func:`lora_pin.ops.shrink` on a paged pool: ``v[t, s*R : s*R + rank] = x[t] @ A_sᵀ``.

    Args:
        x: ``[T, in]``, fp16/bf16/fp32.
        a_pages: ``[num_pages, n_slices * page_rank, in]``, ``x``'s dtype and device.
        pages: the slots' page tables (:class:`lora_pin.ops.paged.PageTable`).
        meta: a layer group's (:meth:`KernelMeta.for_layer`); ``slot_ranks`` bounds each slot's work.
        max_rank: ``R``, each slice's block width in ``v`` (the largest rank a slot may have).
        split_k: programs per segment along ``in`` (fp32 atomics); ``None`` picks from the shapes, as
            :func:`lora_pin.ops.triton_sgmv.sgmv_shrink` does.
        interpret: run under the Triton interpreter (CPU tensors); ``None`` means "unless on CUDA".

    Returns:
        ``v`` ``[T, n_slices * R]`` in ``x.dtype``, zero where no segment covers the row and past each
        slice's rank.

    Raises:
        OpArgumentError: a shape, dtype or device mismatch naming the argument; under the interpreter
            also bad segment or page contents (a page outside the pool, a rank above ``max_rank`` or
            above what the slot's pages hold), or bf16.
        ValueError: ``interpret=False`` with CPU tensors, or ``split_k < 1``.
    """
    check_paged_shrink_args(x, a_pages, pages, meta, max_rank)
    n_slices = meta.n_slices
    interpret = _interpret(x.device, interpret, x.dtype)
    if interpret:
        _check_contents(meta, pages, x.shape[0], max_rank, a_pages.shape[0])

    n_tokens, in_features = x.shape
    n_segments = meta.seg_slots.shape[0]
    if split_k is None:
        # Two waves of programs over the GPU's multiprocessors; a few under the interpreter.
        target = 4 if interpret else 2 * _sm_count(x.device.index or 0)
        split_k = shrink_split_k(
            in_features, n_segments, n_slices, max_rank, x.dtype, target, interpret=interpret
        )
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    v = x.new_zeros(n_tokens, n_slices * max_rank, dtype=torch.float32 if split_k > 1 else x.dtype)
    if n_segments == 0 or n_tokens == 0 or max_rank == 0:
        return v.to(x.dtype)
    launch = paged_shrink_launch(x, a_pages, v, pages, meta, max_rank, split_k, interpret=interpret)
    launch.run(interpret=interpret)
    return v.to(x.dtype)


def paged_shrink_launch(
    x: torch.Tensor,
    a_pages: torch.Tensor,
    v: torch.Tensor,
    pages: PageTable,
    meta: KernelMeta,
    max_rank: int,
    split_k: int,
    *,
    interpret: bool,
) -> KernelLaunch:
    """The paged shrink kernel's launch writing ``v`` (fp32 when ``split_k > 1``); arguments already
    checked (shapes only read)."""
    n_slices, n_segments = meta.n_slices, meta.seg_slots.shape[0]
    block_r = _block_r(max_rank)
    rank_blocks = triton.cdiv(max_rank, block_r)
    return KernelLaunch(
        _paged_shrink_kernel,
        (n_segments, n_slices * rank_blocks, split_k),
        (
            x,
            a_pages,
            v,
            meta.perm.contiguous(),
            meta.seg_indptr.contiguous(),
            meta.seg_slots.contiguous(),
            meta.ranks().contiguous(),
            pages.page_indptr.contiguous(),
            pages.page_table.contiguous(),
            x.shape[1],
            max_rank,
            x.stride(0),
            x.stride(1),
            a_pages.stride(0),
            a_pages.stride(1),
            a_pages.stride(2),
            v.stride(0),
            v.stride(1),
        ),
        {
            "N_SLICES": n_slices,
            "PAGE_RANK": pages.page_rank,
            "RANK_BLOCKS": rank_blocks,
            "SPLIT_K": split_k,
            "BLOCK_M": 16 if interpret else _block_m(meta.perm.shape[0], n_segments),
            "BLOCK_R": block_r,
            "BLOCK_K": _shrink_block_k(x.dtype, block_r, interpret),
            "DOT_PRECISION": _dot_precision(x.dtype),
            "enable_fp_fusion": True,
        },
    )


def paged_expand(
    out: torch.Tensor,
    v: torch.Tensor,
    b_pages: torch.Tensor,
    pages: PageTable,
    meta: KernelMeta,
    *,
    interpret: bool | None = None,
) -> None:
    """:func:`lora_pin.ops.expand` on a paged pool: ``out[rows, slice] += scaling * v @ B_sᵀ``, in place.

    Args:
        out: ``[T, out_total]``, fp16/bf16/fp32, updated in place (rows no segment with a slot covers
            are left bit-exactly as they were).
        v: ``[T, n_slices * R]``, ``out``'s dtype, as :func:`paged_shrink` returns it.
        b_pages: ``[num_pages, out_total, page_rank]``.
        pages: the slots' page tables.
        meta: a layer group's, with scalings and slice offsets.
        interpret: run under the Triton interpreter (CPU tensors); ``None`` means "unless on CUDA".

    Raises:
        OpArgumentError: as :func:`paged_shrink`, or ``meta`` lacks scalings or slice offsets, or the
            slice offsets do not rise from 0 to ``out_total``.
        ValueError: ``interpret=False`` with CPU tensors.
    """
    max_rank = check_paged_expand_args(out, v, b_pages, pages, meta)
    _, slice_offsets = meta.expand_layout()
    interpret = _interpret(out.device, interpret, out.dtype)
    if interpret:
        _check_contents(meta, pages, out.shape[0], max_rank, b_pages.shape[0])

    max_width = max(hi - lo for lo, hi in itertools.pairwise(slice_offsets))
    if meta.seg_slots.shape[0] == 0 or out.shape[0] == 0 or max_rank == 0 or max_width == 0:
        return
    paged_expand_launch(out, v, b_pages, pages, meta, interpret=interpret).run(interpret=interpret)


def paged_expand_launch(
    out: torch.Tensor,
    v: torch.Tensor,
    b_pages: torch.Tensor,
    pages: PageTable,
    meta: KernelMeta,
    *,
    interpret: bool,
) -> KernelLaunch:
    """The paged expand kernel's launch; arguments already checked (shapes only read)."""
    slot_scalings, slice_offsets = meta.expand_layout()
    n_slices, n_segments = len(slice_offsets) - 1, meta.seg_slots.shape[0]
    max_rank = v.shape[1] // n_slices
    max_width = max(hi - lo for lo, hi in itertools.pairwise(slice_offsets))
    block_m = 16 if interpret else _block_m(meta.perm.shape[0], n_segments)
    block_n = 32 if interpret else _expand_block_n(out.dtype, max_rank, block_m)
    offsets = [*slice_offsets] + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    return KernelLaunch(
        _paged_expand_kernel,
        (n_segments, n_slices, triton.cdiv(max_width, block_n)),
        (
            out,
            v,
            b_pages,
            meta.perm.contiguous(),
            meta.seg_indptr.contiguous(),
            meta.seg_slots.contiguous(),
            meta.ranks().contiguous(),
            slot_scalings.contiguous(),
            pages.page_indptr.contiguous(),
            pages.page_table.contiguous(),
            max_rank,
            out.stride(0),
            out.stride(1),
            v.stride(0),
            v.stride(1),
            b_pages.stride(0),
            b_pages.stride(1),
            b_pages.stride(2),
            *offsets,
        ),
        {
            "N_SLICES": n_slices,
            "PAGE_RANK": pages.page_rank,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_R": _block_r(max_rank),
            "DOT_PRECISION": _dot_precision(out.dtype),
            "enable_fp_fusion": True,
        },
    )
