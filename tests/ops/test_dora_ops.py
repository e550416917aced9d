"""``lora_pin::dora_scale_`` against its float64 reference: the torch (CPU) path and the Triton kernel under
the interpreter (fp32/fp16, tiny grids), over adapter popularity patterns; rows of base and plain-LoRA slots
untouched bit for bit; ``opcheck``; bad arguments refused by name; the CPU layers' row rescale, native
for float32 and in torch otherwise. The CUDA test runs where a GPU is."""

from __future__ import annotations

import pytest
import torch

from lora_pin._testing import PATTERNS, request_slots
from lora_pin.ops import OpArgumentError, dora_scale_, dora_scale_reference
from lora_pin.ops.dora import _native, scale_rows_

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SLOTS = 6


def _case(pattern: str, dtype: torch.dtype, seed: int, *, bias: bool, width: int = 40, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    slots = request_slots(pattern, 12, SLOTS, gen, base_fraction=0.2)
    out = torch.randn(slots.shape[0], width, generator=gen).to(device=device, dtype=dtype)
    factors = (1 + 0.3 * torch.randn(SLOTS, width, generator=gen)).to(device=device, dtype=dtype)
    # Every other slot the requests use holds a DoRA adapter, the rest plain LoRA ones (or nothing).
    used = sorted({s for s in slots.tolist() if s >= 0})
    dora = torch.zeros(SLOTS, dtype=torch.int32)
    dora[used[::2]] = 1
    dora = dora.to(device)
    rows = torch.randperm(slots.shape[0], generator=gen).to(device)
    row_slots = slots.to(device=device, dtype=torch.int32)[rows]
    shift = torch.randn(width, generator=gen).to(device=device, dtype=dtype) if bias else None
    return out, shift, factors, dora, rows, row_slots


def _check(got: torch.Tensor, before: torch.Tensor, case: tuple) -> None:
    _, shift, factors, dora, rows, row_slots = case
    want = dora_scale_reference(before, shift, factors, dora, rows, row_slots)
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
    scaled = {r for r, s in zip(rows.tolist(), row_slots.tolist(), strict=True) if s >= 0 and dora[s]}
    assert scaled, "the case has no DoRA row"
    for row in range(before.shape[0]):
        if row not in scaled:
            assert torch.equal(got[row], before[row]), f"row {row} (no DoRA slot) was written"


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_torch_path_matches_reference(pattern: str, dtype: torch.dtype, bias: bool) -> None:
    case = _case(pattern, dtype, 3, bias=bias)
    before = case[0].clone()
    dora_scale_(*case)
    _check(case[0], before, case)


@pytest.mark.triton
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("pattern", ["distinct", "skewed"])
def test_triton_kernel_matches_reference_interpreted(pattern: str, dtype: torch.dtype, bias: bool) -> None:
    triton_dora = pytest.importorskip("lora_pin.ops.triton_dora")
    case = _case(pattern, dtype, 4, bias=bias, width=40)  # 40: a partial column block
    before = case[0].clone()
    triton_dora.dora_scale_triton(*case, interpret=True)
    _check(case[0], before, case)


def _dora_rows(case: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's DoRA rows and their slots, int64, as the CPU layers pick them for ``scale_rows_``."""
    _, _, _, dora, rows, row_slots = case
    keep = (row_slots >= 0) & (dora[row_slots.clamp_min(0).long()] != 0)
    return rows[keep], row_slots[keep].long()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_native_and_torch_row_rescale_match_reference(pattern: str, bias: bool) -> None:
    """``scale_rows_`` on contiguous float32 (the native call) and on a strided ``out`` (torch's gathers)
    both give the reference, and leave every other row bit for bit."""
    case = _case(pattern, torch.float32, 8, bias=bias, width=72)
    out, shift, factors = case[0], case[1], case[2]
    rows, slots = _dora_rows(case)
    assert _native(out, shift, factors, rows, slots)
    before = out.clone()
    scale_rows_(out, shift, factors, rows, slots)
    _check(out, before, case)
    strided = before.t().contiguous().t()
    assert not _native(strided, shift, factors, rows, slots)
    scale_rows_(strided, shift, factors, rows, slots)
    _check(strided, before, case)


def test_native_row_rescale_refuses_bad_indices_writing_nothing() -> None:
    case = _case("uniform", torch.float32, 9, bias=True)
    out, shift, factors = case[0], case[1], case[2]
    rows, slots = _dora_rows(case)
    before = out.clone()
    for bad_rows, bad_slots, message in (
        (rows.clone().fill_(12), slots, "row 12 outside"),
        (rows, slots + SLOTS, r"slot \d+ outside \[0, 6\)"),
        (rows, slots[:-1], "rows but"),
    ):
        with pytest.raises(OpArgumentError, match=message):
            scale_rows_(out, shift, factors, bad_rows, bad_slots)
        assert torch.equal(out, before)


def test_opcheck() -> None:
    case = _case("uniform", torch.float32, 5, bias=True)
    torch.library.opcheck(torch.ops.lora_pin.dora_scale_, case)
    no_bias = _case("zipf", torch.float16, 6, bias=False)
    torch.library.opcheck(torch.ops.lora_pin.dora_scale_, no_bias)


def test_bad_arguments_refused_and_out_unchanged() -> None:
    out, shift, factors, dora, rows, row_slots = _case("uniform", torch.float32, 7, bias=True)
    before = out.clone()
    bad = [
        ((out, shift, factors.half(), dora, rows, row_slots), r"factors must be \[slots, 40\] torch.float32"),
        ((out, shift, factors, dora.long(), rows, row_slots), r"dora must be int32 \[6\]"),
        ((out, shift, factors, dora, rows.int(), row_slots), r"rows must be int64"),
        ((out, shift, factors, dora, rows, row_slots[:-1]), r"row_slots must be int32 \[12\]"),
        ((out, shift[:-1], factors, dora, rows, row_slots), r"bias must be \[40\]"),
        ((out, shift, factors, dora, rows + 100, row_slots), r"rows must lie in \[0, 12\)"),
        ((out, shift, factors, dora, rows, row_slots + SLOTS), r"row_slots must lie in \[-1, 6\)"),
    ]
    for args, message in bad:
        with pytest.raises(OpArgumentError, match=message):
            dora_scale_(*args)
        assert torch.equal(out, before)
    out.requires_grad_(True)
    with pytest.raises(OpArgumentError, match="no autograd formula"):
        dora_scale_(out, shift, factors, dora, rows, row_slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_kernel_matches_reference(dtype: torch.dtype) -> None:
    case = _case("skewed", dtype, 8, bias=True, width=300, device="cuda")
    before = case[0].clone()
    dora_scale_(*case)
    torch.cuda.synchronize()
    _check(case[0], before, case)
