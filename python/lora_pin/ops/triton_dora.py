"""The DoRA rescale in Triton: ``out[r] = f[slot] * (out[r] - bias) + bias`` on the rows of DoRA slots.

One program per block of rows and block of output columns: it loads its rows' slots and their DoRA
flags and masks out every row whose slot is -1 or holds no DoRA adapter in the group, so those rows are
never written. The launcher reads shapes only, so a CUDA graph can capture it. As in
:mod:`lora_pin.ops.triton_sgmv`, the kernel is a plain function wrapped either by ``triton.jit`` (CUDA)
or by the Triton interpreter (CPU tensors, tests), calling only ``triton.language`` builtins.
"""

from __future__ import annotations

import torch
import triton.language as tl

from lora_pin.errors import OpArgumentError
from lora_pin.ops._checks import check_dora_args
from lora_pin.ops.triton_sgmv import _COMPILE_OPTIONS, KernelLaunch

__all__ = ["dora_scale_launch", "dora_scale_triton"]


def _dora_scale_kernel(
    out_ptr,  # [T, O]
    bias_ptr,  # [O] (unused without HAS_BIAS)
    factors_ptr,  # [slots, O]
    dora_ptr,  # int32 [slots]
    rows_ptr,  # int64 [N]
    row_slots_ptr,  # int32 [N]
    n_rows,
    width,
    stride_ot,
    stride_oo,
    stride_fs,
    stride_fo,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = offs_m < n_rows
    row = tl.load(rows_ptr + offs_m, mask=in_rows, other=0)
    slot = tl.load(row_slots_ptr + offs_m, mask=in_rows, other=-1)
    has_slot = in_rows & (slot >= 0)
    safe_slot = tl.where(has_slot, slot, 0)
    flag = tl.load(dora_ptr + safe_slot, mask=has_slot, other=0)
    active = has_slot & (flag != 0)
    mask = active[:, None] & (offs_n < width)[None, :]
    out_at = out_ptr + row[:, None] * stride_ot + offs_n[None, :] * stride_oo
    value = tl.load(out_at, mask=mask, other=0.0).to(tl.float32)
    factor = tl.load(
        factors_ptr + safe_slot[:, None] * stride_fs + offs_n[None, :] * stride_fo, mask=mask, other=1.0
    ).to(tl.float32)
    if HAS_BIAS:
        shift = tl.load(bias_ptr + offs_n, mask=offs_n < width, other=0.0).to(tl.float32)
        value = (value - shift[None, :]) * factor + shift[None, :]
    else:
        value = value * factor
    tl.store(out_at, value.to(out_ptr.dtype.element_ty), mask=mask)


def dora_scale_launch(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    *,
    interpret: bool,
) -> KernelLaunch | None:
    """The launch of the rescale kernel (shapes as :func:`lora_pin.ops.dora_scale_`), or None when there
    are no rows; shapes checked, contents not read.

    Raises:
        OpArgumentError: as :func:`lora_pin.ops._checks.check_dora_args`.
    """
    check_dora_args(out, bias, factors, dora, rows, row_slots)
    n_rows, width = rows.shape[0], out.shape[1]
    if n_rows == 0 or width == 0:
        return None
    block_m = 16
    block_n = 32 if interpret else 128
    grid = ((n_rows + block_m - 1) // block_m, (width + block_n - 1) // block_n, 1)
    args = (
        out,
        factors if bias is None else bias,
        factors,
        dora,
        rows,
        row_slots,
        n_rows,
        width,
        out.stride(0),
        out.stride(1),
        factors.stride(0),
        factors.stride(1),
    )
    constexprs = {
        "HAS_BIAS": bias is not None,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        **_COMPILE_OPTIONS,
    }
    return KernelLaunch(_dora_scale_kernel, grid, args, constexprs)


def dora_scale_triton(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    factors: torch.Tensor,
    dora: torch.Tensor,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    *,
    interpret: bool | None = None,
) -> None:
    """:func:`lora_pin.ops.dora_scale_` through the Triton kernel: compiled for CUDA tensors, under the
    interpreter for CPU tensors (``interpret`` None picks by device; fp16/fp32 only there).

    Raises:
        OpArgumentError: as :func:`dora_scale_launch`; bf16 under the interpreter (it computes bf16 wrongly).
        ValueError: ``interpret=False`` with CPU tensors.
    """
    if interpret is None:
        interpret = out.device.type != "cuda"
    if not interpret and out.device.type != "cuda":
        raise ValueError(f"compiled Triton kernels need CUDA tensors, got {out.device}; pass interpret=True")
    if interpret and out.dtype == torch.bfloat16:
        raise OpArgumentError("the Triton interpreter computes bf16 wrongly; use fp16 or fp32 there")
    launch = dora_scale_launch(out, bias, factors, dora, rows, row_slots, interpret=interpret)
    if launch is not None:
        launch.run(interpret=interpret)
