"""The grouped torch path: few GEMMs per (slot, slice) over contiguous row blocks, for CPU tensors.

Adjacent segments of one slot (the planner's chunks) are merged into one group. A group whose tokens
form long runs of consecutive tokens (prefill requests; any single decode token) is computed run by run
on views of ``x`` / ``v`` / ``out`` directly; the tokens of groups made of short runs (decode tokens of
one adapter spread over the batch) are gathered once, computed on contiguous views of the gathered
block, and written back once. Each GEMM's inner dimension is the slot's real rank, and the expand GEMM
accumulates into ``out`` in place (``addmm_``: fp32 accumulation, one rounding; a bf16/fp16 group of
up to a dozen rows multiplies in fp32 and adds once, because that is faster there). Nothing is done
per token in Python.

Decode-sized slots (a few tokens each) that share one rank take a batched path instead, one block per
rank over the range of slots they span: their tokens are scattered into a zero-padded
``[slots, tokens_per_slot, in]`` block and each op is one ``bmm`` per slice on views of the pool. No
weight is gathered and nothing past the shared rank is read; idle slots inside the range (allowed
within a padding budget) are computed on zero rows and discarded.

On an x86-64 CPU with AVX-512, slots with few tokens (decode) run in the native kernels instead
(``lora_pin._core.CpuSgmvPlan``, ``rust/kernels/src/sgmv/``): one call per op streams each slot's weights once
with all its tokens in registers, where BLAS would run one matrix-vector product per slot and slice well
below the memory bandwidth. Set ``LORA_PIN_CPU_KERNELS=0`` to keep everything on the torch path.

The plan (groups, gathered rows) is derived from the segment arrays on the host and cached by their
contents, so the shrink and expand of every layer of one step plan once. The ops run this path for
every device but CUDA (where reading the arrays would synchronise; ``benches/gpu_ops.py`` times it
there as the baseline).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from lora_pin._core import CpuSgmvPlan, cpu_features, sgmv_cpu_available
from lora_pin.ops._checks import check_segment_contents
from lora_pin.ops.segments import KernelMeta

__all__ = [
    "CpuOpPlan",
    "blas_runs",
    "build_plan",
    "delta_planned",
    "expand_grouped",
    "expand_planned",
    "kernel_ok",
    "plan_for",
    "shrink_grouped",
    "shrink_mm",
    "shrink_planned",
]

# A slot's rows that split into runs of consecutive tokens at least this long on average are computed
# run by run on views; shorter runs are gathered into one block instead. Gathering copies out's rows
# twice, which pays only when the views would be many small GEMMs. The measurements behind this and the
# other thresholds below are in BENCHMARKS.md (CPU ops, "The thresholds in python/lora_pin/ops/grouped.py").
_MIN_RUN = 16
# The batched path pads every slot of its block to the busiest slot's token count, and an idle slot
# inside the block costs a full read of its weights. Batching saves a little per slot in fp32 and much
# more in bf16/fp16 (oneDNN's fixed cost per call), so the padded rows may exceed the real ones by these
# factors, and only decode-sized groups are taken (a padded row costs about half a row's GEMM).
_DENSE_MAX_TOKENS = 4
_DENSE_MAX_PADDING = 1.1
_DENSE_MAX_PADDING_REDUCED = 1.75
# Rows per group of the native shrink of long runs (_runs_shrink_plan): a 1024-row run's shrink took, on
# one core, 2.74 / 3.24 / 3.43 / 3.92 / 6.50 ms in groups of 32 / 64 / 128 / 256 / 1024 rows against
# 4.23 ms for one MKL GEMM (fp32, 4096 wide, rank 16); 10.3 against 12.1 ms at 14336 wide; bf16 2.08
# against 2.76 and 6.64 against 8.11 ms.
_RUN_SHRINK_ROWS = 32
# A bf16/fp16 expand of at most this many rows multiplies in fp32 (see expand_grouped).
_FP32_PRODUCT_MAX_ROWS = 12
# A bf16 shrink of at most this many columns over at least max(64, 4 x columns) rows runs as
# ``A @ x^T`` (see shrink_mm): 1.16-1.83x faster than ``x @ A^T`` at 8-16 columns and 64-512 rows,
# 1.04-1.15x at 32 columns from 128 rows, 4096 wide, 1 and 2 threads; below those rows, and at 48-64
# columns, oneDNN picks as good a kernel either way (0.5-1.0x) (BENCHMARKS.md, CPU ops).
_BF16_TRANSPOSED_SHRINK_MAX_COLUMNS = 32
# Slots with at most this many tokens go to the native kernels (where the CPU has them); busier slots
# stay on BLAS, whose GEMMs win once a slot has enough rows: oneDNN's bf16 GEMMs catch up sooner than
# fp32 BLAS does. torch's fp16 matmul on CPUs without AVX512-FP16 is far slower than the kernels even
# for prefill, so fp16 always takes them.
_KERNEL_MAX_TOKENS = {torch.float32: 64, torch.bfloat16: 32, torch.float16: sys.maxsize}
# A paged bf16 slot with at most this many tokens stays in the native kernels: BLAS would first gather
# its pages. One slot of 64 bf16 decode tokens, 4096 wide, 1 thread, AMX, cold (min of 15): rank 8, native
# 0.75 ms against 1.36 gathered for BLAS; rank 64, 1.31-1.42 against 1.44-1.52. At 8 x 128 prefill
# tokens BLAS wins (the shrink 2.5 against 6.5 ms).
_PAGED_BF16_KERNEL_MAX_TOKENS = 64
_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Whether the native kernels run at all: the CPU must have them, and LORA_PIN_CPU_KERNELS=0 turns them off.
use_cpu_kernels = sgmv_cpu_available() and os.environ.get("LORA_PIN_CPU_KERNELS", "1") != "0"
# Where the CPU has AMX (bf16 tiles), oneDNN's bf16 GEMM expands long runs about as fast as the native
# panel expand or faster (the panel 0.82-1.07x of it, median 0.93x, over 8 runs of 128 rows and one of
# 1024, plain and q/k/v, 4096 wide, one thread; BENCHMARKS.md, CPU ops), so bf16 runs keep BLAS there.
# Without AMX the panel expand wins (1.9 against 3.7 ms at 8 x 128 rows, two threads).
_BF16_RUNS_NATIVE_EXPAND = not cpu_features()["amx_bf16"]
# Distinct plans kept: one per (step, layer group with its own ranks); a model has a handful of groups.
_PLAN_CACHE_SIZE = 16


class _Run(NamedTuple):
    """One GEMM's rows taken as views: ``size`` consecutive tokens from ``start``, all of ``slot``."""

    slot: int
    start: int
    size: int


class _Dense(NamedTuple):
    """Slots ``[first_slot, first_slot + n_slots)`` batched at one ``rank`` in every slice.

    Slots of the range with no token in ``rows`` are idle: computed on zero rows, never written back.
    """

    first_slot: int
    n_slots: int
    tokens_per_slot: int
    rank: int
    # int64 [N]: the tokens, by slot.
    rows: torch.Tensor
    # int64 [N]: each token's row in the padded [n_slots * tokens_per_slot] block; None: row i is i.
    positions: torch.Tensor | None


class CpuOpPlan(NamedTuple):
    """How one call runs: which slots are batched, which rows are views, which are gathered."""

    ranks: list[list[int]]
    runs: list[_Run]
    # Token indices of the gathered block, in order; None when nothing is gathered.
    gathered_rows: torch.Tensor | None
    # Slot and row count of each group of the gathered block, in block order.
    gathered_slots: list[int]
    gathered_sizes: list[int]
    # Blocks of slots taken by the batched path (none of their tokens is in runs or the gathered block).
    dense: list[_Dense]
    # Slots run by the native kernels (none of their tokens is anywhere else); None when there are none.
    kernel: CpuSgmvPlan | None = None
    # The shrink of the runs' rows in the native kernels, fp32 on one thread.
    runs_shrink: CpuSgmvPlan | None = None
    # The expand of the runs' rows in the native kernels, one group per run (_runs_expand_plan).
    runs_expand: CpuSgmvPlan | None = None

    @property
    def empty(self) -> bool:
        """Whether the call has no work: no row uses a slot with a rank in this layer group."""
        return not (self.runs or self.gathered_rows is not None or self.dense or self.kernel is not None)


def _content(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return str(t.dtype), tuple(t.shape), t.detach().cpu().contiguous().numpy().tobytes()


class PlanCache:
    """Plans keyed by the contents of the segment arrays and ranks (never by identity: a buffer the
    planner refills in place, or a new tensor at a freed address, must not hit a stale plan)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._plans: OrderedDict[Hashable, CpuOpPlan] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, meta: KernelMeta, n_tokens: int, max_rank: int, dtype: torch.dtype, kernel: bool = False
    ) -> CpuOpPlan:
        max_padding = _DENSE_MAX_PADDING if dtype == torch.float32 else _DENSE_MAX_PADDING_REDUCED
        kernel_tokens = _KERNEL_MAX_TOKENS[dtype] if kernel else 0
        key = (
            str(meta.perm.device),
            n_tokens,
            max_rank,
            max_padding,
            kernel_tokens,
            *(_content(t) for t in (meta.perm, meta.seg_indptr, meta.seg_slots, meta.ranks())),
        )
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = build_plan(meta, n_tokens, max_rank, dtype, kernel)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan


_PLANS = PlanCache(_PLAN_CACHE_SIZE)


def _dense_blocks(
    spans: list[list[int]], perm: torch.Tensor, ranks: list[list[int]], max_padding: float
) -> tuple[list[_Dense], list[list[int]]]:
    """Picks the slots the batched path takes; returns its blocks and the spans left to the other paths.

    Candidates are the slots with at most ``_DENSE_MAX_TOKENS`` tokens and one rank in every slice;
    per rank, the block is the candidates with at most ``T`` tokens, over the slot range they span, for
    the ``T`` that takes the most slots while the padded rows (idle slots of the range included) stay
    within ``max_padding`` times the real ones.
    """
    counts: dict[int, int] = {}
    for slot, lo, hi in spans:
        counts[slot] = counts.get(slot, 0) + hi - lo
    by_rank: dict[int, list[int]] = {}
    for slot, count in counts.items():
        rank = ranks[slot][0]
        if count <= _DENSE_MAX_TOKENS and all(r == rank for r in ranks[slot]):
            by_rank.setdefault(rank, []).append(slot)
    blocks: list[_Dense] = []
    taken: set[int] = set()
    for rank, candidates in by_rank.items():
        best: list[int] = []
        for per_slot in range(1, _DENSE_MAX_TOKENS + 1):
            members = [slot for slot in candidates if counts[slot] <= per_slot]
            if len(members) < 2 or len(members) <= len(best):
                continue
            padded = (max(members) - min(members) + 1) * per_slot
            if padded <= max_padding * sum(counts[slot] for slot in members):
                best = members
        if not best:
            continue
        first, last, per_slot = min(best), max(best), max(counts[slot] for slot in best)
        chosen = set(best)
        by_slot = sorted((span for span in spans if span[0] in chosen), key=lambda span: span[0])
        rows = torch.cat([perm[lo:hi] for _, lo, hi in by_slot])
        positions = None
        if (last - first + 1) * per_slot != rows.shape[0]:  # else every padded row is a token, in order
            positions = torch.tensor(
                [
                    (slot - first) * per_slot + i
                    for slot in range(first, last + 1)
                    if slot in chosen
                    for i in range(counts[slot])
                ],
                dtype=torch.int64,
                device=perm.device,
            )
        blocks.append(_Dense(first, last - first + 1, per_slot, rank, rows, positions))
        taken |= chosen
    return blocks, [span for span in spans if span[0] not in taken]


def build_plan(
    meta: KernelMeta, n_tokens: int, max_rank: int, dtype: torch.dtype, kernel: bool = False
) -> CpuOpPlan:
    """Reads the segment arrays once (checking their contents) and decides: the native kernels (when
    ``kernel``), the batched path, or per group views or gathering.

    Raises:
        OpArgumentError: as :func:`lora_pin.ops._checks.check_segment_contents`.
    """
    max_padding = _DENSE_MAX_PADDING if dtype == torch.float32 else _DENSE_MAX_PADDING_REDUCED
    kernel_tokens = _KERNEL_MAX_TOKENS[dtype] if kernel else 0
    perm = meta.perm
    indptr, seg_slot_list, ranks = meta.seg_indptr.tolist(), meta.seg_slots.tolist(), meta.ranks().tolist()
    check_segment_contents(perm, indptr, seg_slot_list, ranks, n_tokens, max_rank)
    n_rows = perm.shape[0]

    # (slot, lo, hi) into perm, with adjacent segments of one slot merged and no-op slots dropped.
    spans: list[list[int]] = []
    for s, slot in enumerate(seg_slot_list):
        lo, hi = indptr[s], indptr[s + 1]
        if slot < 0 or lo == hi or not any(ranks[slot]):
            continue
        if spans and spans[-1][0] == slot and spans[-1][2] == lo:
            spans[-1][2] = hi
        else:
            spans.append([slot, lo, hi])
    if not spans:
        return CpuOpPlan(ranks, [], None, [], [], [])
    native = None
    if kernel_tokens:
        native, spans = _kernel_groups(spans, perm, ranks, n_tokens, max_rank, kernel_tokens)
        if not spans:
            return CpuOpPlan(ranks, [], None, [], [], [], native)
    dense, spans = _dense_blocks(spans, perm, ranks, max_padding)
    if not spans:
        return CpuOpPlan(ranks, [], None, [], [], dense, native)

    # Cut every span into runs of consecutive tokens. Runs long enough for a GEMM to pay become views
    # (no copy); a span of short runs (decode tokens of one adapter spread over the batch) is gathered.
    breaks = torch.ones(n_rows, dtype=torch.bool, device=perm.device)
    torch.ne(perm[1:], perm[:-1] + 1, out=breaks[1:])
    run_starts = torch.nonzero(breaks).flatten()
    starts, start_tokens = torch.stack([run_starts, perm[run_starts]]).tolist()

    runs: list[_Run] = []
    gathered_spans: list[tuple[int, int]] = []
    gathered_slots: list[int] = []
    run = 0  # index into starts of the run holding the current span's first row
    for slot, lo, hi in spans:
        while run + 1 < len(starts) and starts[run + 1] <= lo:
            run += 1
        cuts = [lo]
        nxt = run + 1
        while nxt < len(starts) and starts[nxt] < hi:
            cuts.append(starts[nxt])
            nxt += 1
        if len(cuts) == 1 or hi - lo >= _MIN_RUN * len(cuts):
            first_token = start_tokens[run] + lo - starts[run]
            tokens = [first_token] + [start_tokens[i] for i in range(run + 1, nxt)]
            for cut_lo, cut_hi, token in zip(cuts, [*cuts[1:], hi], tokens, strict=True):
                runs.append(_Run(slot, token, cut_hi - cut_lo))
        else:
            gathered_spans.append((lo, hi))
            gathered_slots.append(slot)
    if not gathered_spans:
        rows = None
    elif sum(hi - lo for lo, hi in gathered_spans) == n_rows:
        rows = perm  # the spans are in perm's order and cover it
    else:
        rows = torch.cat([perm[lo:hi] for lo, hi in gathered_spans])
    # fp32 only: in bf16, oneDNN's shrink (AVX512-BF16 dot products) beat the kernels' on q/k/v (1.2-1.6x
    # against 1.0-1.6x the best baseline, one thread) and tied on a plain layer.
    native_runs = bool(kernel_tokens and runs) and dtype == torch.float32
    runs_shrink = _runs_shrink_plan(runs, ranks, n_tokens, max_rank) if native_runs else None
    native_expand = dtype != torch.bfloat16 or _BF16_RUNS_NATIVE_EXPAND
    runs_expand = (
        _runs_expand_plan(runs, ranks, n_tokens, max_rank)
        if kernel_tokens and runs and native_expand
        else None
    )
    sizes = [hi - lo for lo, hi in gathered_spans]
    return CpuOpPlan(ranks, runs, rows, gathered_slots, sizes, dense, native, runs_shrink, runs_expand)


def _runs_expand_plan(runs: list[_Run], ranks: list[list[int]], n_tokens: int, max_rank: int) -> CpuSgmvPlan:
    """The native kernels' plan for the expand of ``runs``, one group per run.

    A group of many tokens takes the kernels' panel expand (``rust/kernels/src/sgmv/avx512.rs``): each block
    of 16 rows of the slot's B is transposed once and every token's row of ``out`` streams through the
    blocks, where BLAS's GEMM of inner dimension ``rank`` ran well below the speed of reading and
    writing ``out`` (8 runs of 128 rows, 4096 wide, rank 16: 2.7 against 4.6 ms fp32, 2.8 against
    4.1 ms bf16 on one thread; 2.2 against 6.8 and 1.9 against 3.7 ms on two; BENCHMARKS.md, CPU ops)."""
    indptr = [0]
    tokens: list[int] = []
    for run in runs:
        tokens.extend(range(run.start, run.start + run.size))
        indptr.append(len(tokens))
    return CpuSgmvPlan(
        n_tokens,
        tokens,
        indptr,
        [run.slot for run in runs],
        [r for row in ranks for r in row],
        n_slices=len(ranks[0]),
        max_rank=max_rank,
    )


def _runs_shrink_plan(runs: list[_Run], ranks: list[list[int]], n_tokens: int, max_rank: int) -> CpuSgmvPlan:
    """The native kernels' plan for the shrink of ``runs``, each cut into groups of at most
    ``_RUN_SHRINK_ROWS`` rows.

    The runs' expand stays on BLAS, whose GEMMs beat the kernels' expand once a slot has many rows, but
    their shrink (``[rows, in] @ [in, rank]``, a GEMM of few columns) is faster in the kernels when a
    group's rows of ``x`` stay in cache while the slot's A streams past them (BENCHMARKS.md, CPU ops)."""
    indptr = [0]
    tokens: list[int] = []
    slots: list[int] = []
    for run in runs:
        for start in range(run.start, run.start + run.size, _RUN_SHRINK_ROWS):
            tokens.extend(range(start, min(start + _RUN_SHRINK_ROWS, run.start + run.size)))
            indptr.append(len(tokens))
            slots.append(run.slot)
    return CpuSgmvPlan(
        n_tokens,
        tokens,
        indptr,
        slots,
        [r for row in ranks for r in row],
        n_slices=len(ranks[0]),
        max_rank=max_rank,
    )


def _kernel_groups(
    spans: list[list[int]],
    perm: torch.Tensor,
    ranks: list[list[int]],
    n_tokens: int,
    max_rank: int,
    max_tokens: int,
) -> tuple[CpuSgmvPlan | None, list[list[int]]]:
    """Hands the slots with at most ``max_tokens`` tokens to the native kernels; returns their plan
    (None if there are none) and the spans left to the torch paths."""
    counts: dict[int, int] = {}
    for slot, lo, hi in spans:
        counts[slot] = counts.get(slot, 0) + hi - lo
    mine = [span for span in spans if counts[span[0]] <= max_tokens]
    if not mine:
        return None, spans
    indptr = [0]
    for _, lo, hi in mine:
        indptr.append(indptr[-1] + hi - lo)
    tokens = torch.cat([perm[lo:hi] for _, lo, hi in mine]).tolist()
    native = CpuSgmvPlan(
        n_tokens,
        tokens,
        indptr,
        [slot for slot, _, _ in mine],
        [r for row in ranks for r in row],
        n_slices=len(ranks[0]),
        max_rank=max_rank,
    )
    return native, [span for span in spans if counts[span[0]] > max_tokens]


def _raw(t: torch.Tensor) -> tuple[int, int]:
    """A contiguous CPU tensor's memory as the native kernels take it: address and element count."""
    return t.data_ptr(), t.numel()


def blas_runs(dtype: torch.dtype, n_rows: int, *, paged: bool = False) -> tuple[bool, bool]:
    """Whether one slot's ``n_rows`` rows (long runs of consecutive tokens) shrink and expand faster in
    BLAS than in the native kernels: ``(shrink, expand)``. The rule for bf16, on this path and the paged
    one (``paged``, :mod:`lora_pin.ops.paged_native`): a slot past the kernels' token limit shrinks in
    oneDNN (AVX512-BF16 dot products), and expands there where the CPU has AMX; fp32 and fp16 stay in
    the kernels. A paged slot must first gather its pages for BLAS, so its limit is higher
    (``_PAGED_BF16_KERNEL_MAX_TOKENS``)."""
    limit = _PAGED_BF16_KERNEL_MAX_TOKENS if paged else _KERNEL_MAX_TOKENS[dtype]
    if dtype != torch.bfloat16 or n_rows <= limit:
        return False, False
    return True, not _BF16_RUNS_NATIVE_EXPAND


def kernel_ok(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Whether this call may run the native kernels: a CPU that has them, a dtype they take, and CPU
    tensors they can read in place (contiguous)."""
    return (
        use_cpu_kernels
        and dtype in _KERNEL_MAX_TOKENS
        and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    )


def _shrink_dense(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    v: torch.Tensor,  # [T, n_slices * R], zero, written
    d: _Dense,
    n_slices: int,
) -> None:
    max_rank = a.shape[1] // n_slices
    n, per_slot = d.n_slots, d.tokens_per_slot
    x_rows = x.index_select(0, d.rows)
    if d.positions is not None:
        x_rows = x.new_zeros(n * per_slot, x.shape[1]).index_copy_(0, d.positions, x_rows)
    x_block = x_rows.view(n, per_slot, x.shape[1])
    a_t = a[d.first_slot : d.first_slot + n].transpose(1, 2)  # [n, in, n_slices * R], a view
    if d.rank == max_rank:
        v_block = torch.bmm(x_block, a_t)  # [n, per_slot, n_slices * R]
    else:
        v_block = x.new_zeros(n, per_slot, n_slices * max_rank)
        for s in range(n_slices):
            cols = slice(s * max_rank, s * max_rank + d.rank)
            v_block[:, :, cols] = torch.bmm(x_block, a_t[:, :, cols])
    v_rows = v_block.view(n * per_slot, -1)
    if d.positions is not None:
        v_rows = v_rows.index_select(0, d.positions)
    v.index_copy_(0, d.rows, v_rows)


def _expand_dense(
    out: torch.Tensor,  # [T, out_total], updated in place
    v: torch.Tensor,  # [T, n_slices * R]
    b: torch.Tensor,  # [slots, out_total, R]
    slot_scalings: torch.Tensor,  # float32 [slots, n_slices]
    slice_offsets: Sequence[int],
    d: _Dense,
) -> None:
    max_rank, n_slices = b.shape[2], len(slice_offsets) - 1
    n, per_slot, rank = d.n_slots, d.tokens_per_slot, d.rank
    v_rows = v.index_select(0, d.rows)
    out_rows = out.index_select(0, d.rows)
    if d.positions is not None:
        v_rows = v.new_zeros(n * per_slot, v.shape[1]).index_copy_(0, d.positions, v_rows)
        out_rows = out.new_zeros(n * per_slot, out.shape[1]).index_copy_(0, d.positions, out_rows)
    # Scaled in fp32 and rounded once; the GEMMs then accumulate into out's rows in place. fp16 stays in
    # fp32: v * scaling can pass fp16's largest value (65504) where the result does not, and torch's fp16
    # matmul on CPU is the slow one anyway.
    scalings = slot_scalings[d.first_slot : d.first_slot + n].view(n, 1, n_slices, 1)
    v_block = v_rows.view(n, per_slot, n_slices, max_rank)[..., :rank].float() * scalings
    if out.dtype == torch.bfloat16:
        v_block = v_block.to(v.dtype)
    out_block = out_rows.view(n, per_slot, out.shape[1])
    b_block = b[d.first_slot : d.first_slot + n, :, :rank]  # [n, out_total, rank], a view
    for s in range(n_slices):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        if lo == hi:
            continue
        if out.dtype == torch.float32:
            out_block[:, :, lo:hi].baddbmm_(v_block[:, :, s], b_block[:, lo:hi].transpose(1, 2))
        elif out.dtype == torch.float16:
            delta = torch.bmm(v_block[:, :, s], b_block[:, lo:hi].float().transpose(1, 2))
            out_block[:, :, lo:hi].add_(delta)  # added in fp32, rounded once
        else:
            # oneDNN's reduced-precision bmm is faster with the weights as the left operand, and its
            # baddbmm_ into a transposed view takes a slow path, so the product is added after.
            delta = torch.bmm(b_block[:, lo:hi], v_block[:, :, s].transpose(1, 2))  # [n, width, per_slot]
            out_block[:, :, lo:hi].add_(delta.transpose(1, 2))
    if d.positions is not None:
        out_rows = out_rows.index_select(0, d.positions)
    out.index_copy_(0, d.rows, out_rows)


def shrink_grouped(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    meta: KernelMeta,
) -> torch.Tensor:
    """:func:`lora_pin.ops.shrink` on CPU; arguments already checked by ``check_shrink_args``."""
    max_rank = a.shape[1] // meta.n_slices
    kernel = x.device.type == "cpu" and kernel_ok(x.dtype, a)
    return shrink_planned(x, a, meta.n_slices, _PLANS.get(meta, x.shape[0], max_rank, x.dtype, kernel))


def shrink_planned(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    n_slices: int,
    plan: CpuOpPlan,
) -> torch.Tensor:
    """Shrink by a plan made for these shapes (:func:`build_plan`); returns ``v`` ``[T, n_slices * R]``."""
    max_rank = a.shape[1] // n_slices
    v = x.new_zeros(x.shape[0], n_slices * max_rank)  # [T, n_slices * R]
    if plan.kernel is not None:
        xc = x.contiguous()
        plan.kernel.shrink(
            _KERNEL_DTYPES[x.dtype], _raw(xc), xc.shape[1], _raw(a), _raw(v), threads=torch.get_num_threads()
        )
    for block in plan.dense:
        _shrink_dense(x, a, v, block, n_slices)

    def shrink_rows(xs: torch.Tensor, vs: torch.Tensor, slot: int) -> None:
        ranks = plan.ranks[slot]
        if all(r == max_rank for r in ranks):
            shrink_mm(xs, a[slot], out=vs)
            return
        for s, rank in enumerate(ranks):
            if rank:
                cols = slice(s * max_rank, s * max_rank + rank)
                shrink_mm(xs, a[slot, cols], out=vs[:, cols])

    for run in plan.runs:
        rows = slice(run.start, run.start + run.size)
        shrink_rows(x[rows], v[rows], run.slot)
    if plan.gathered_rows is not None:
        x_gathered = x.index_select(0, plan.gathered_rows)
        v_gathered = x.new_zeros(plan.gathered_rows.shape[0], n_slices * max_rank)
        sizes = plan.gathered_sizes
        for xs, vs, slot in zip(
            x_gathered.split(sizes), v_gathered.split(sizes), plan.gathered_slots, strict=True
        ):
            shrink_rows(xs, vs, slot)
        v.index_copy_(0, plan.gathered_rows, v_gathered)
    return v


def expand_grouped(
    out: torch.Tensor,  # [T, out_total], updated in place
    v: torch.Tensor,  # [T, n_slices * R]
    b: torch.Tensor,  # [slots, out_total, R]
    meta: KernelMeta,
) -> None:
    """:func:`lora_pin.ops.expand` on CPU; arguments already checked by ``check_expand_args``."""
    slot_scalings, slice_offsets = meta.expand_layout()
    kernel = kernel_ok(out.dtype, out, b, slot_scalings)
    plan = _PLANS.get(meta, out.shape[0], b.shape[2], out.dtype, kernel)
    expand_planned(out, v, b, slot_scalings, slice_offsets, plan)


def expand_planned(
    out: torch.Tensor,  # [T, out_total], updated in place
    v: torch.Tensor,  # [T, n_slices * R]
    b: torch.Tensor,  # [slots, out_total, R]
    slot_scalings: torch.Tensor,  # float32 [slots, n_slices]
    slice_offsets: Sequence[int],
    plan: CpuOpPlan,
) -> None:
    """Expand by a plan made for these shapes (:func:`build_plan`). The runs take the native kernels'
    expand where the plan has one and ``out`` is contiguous (:func:`_runs_expand_plan`), else BLAS."""
    max_rank = b.shape[2]
    n_slices = len(slice_offsets) - 1
    if plan.kernel is not None:
        vc = v.contiguous()
        plan.kernel.expand(
            _KERNEL_DTYPES[out.dtype],
            _raw(out),
            _raw(vc),
            _raw(b),
            _raw(slot_scalings),
            slice_offsets,
            threads=torch.get_num_threads(),
        )
    for block in plan.dense:
        _expand_dense(out, v, b, slot_scalings, slice_offsets, block)
    runs = plan.runs
    if plan.runs_expand is not None and out.is_contiguous():
        vc = v.contiguous()
        plan.runs_expand.expand(
            _KERNEL_DTYPES[out.dtype],
            _raw(out),
            _raw(vc),
            _raw(b),
            _raw(slot_scalings),
            slice_offsets,
            threads=torch.get_num_threads(),
        )
        runs = []
    if not runs and plan.gathered_rows is None:
        return
    scalings = slot_scalings.tolist()
    # A bf16/fp16 addmm_ of a few rows with K = rank pays a large fixed cost in oneDNN; the product in
    # fp32, added once, is faster there (and rounds once) up to about a dozen rows.
    reduced_precision = out.dtype != torch.float32

    def expand_rows(outs: torch.Tensor, vs: torch.Tensor, b_t: torch.Tensor, slot: int, s: int) -> None:
        # outs: [rows, width_s]; vs: [rows, R] (slice s of v); b_t: [slots, R, width_s]
        rank = plan.ranks[slot][s]
        if not rank:
            return
        if rank < max_rank:
            vs, b_slot = vs[:, :rank], b_t[slot, :rank]
        else:
            b_slot = b_t[slot]
        if reduced_precision and outs.shape[0] <= _FP32_PRODUCT_MAX_ROWS:
            outs.add_(torch.mm(vs.float(), b_slot.float()), alpha=scalings[slot][s])
        else:
            outs.addmm_(vs, b_slot, alpha=scalings[slot][s])

    if plan.gathered_rows is not None:
        out_gathered = out.index_select(0, plan.gathered_rows)
        v_gathered = v.index_select(0, plan.gathered_rows)
    sizes = plan.gathered_sizes
    for s in range(n_slices):
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        if lo == hi:
            continue
        b_t = b[:, lo:hi].transpose(1, 2)  # [slots, R, width_s]
        out_s, v_s = out[:, lo:hi], v[:, s * max_rank : (s + 1) * max_rank]
        for run in runs:
            rows = slice(run.start, run.start + run.size)
            expand_rows(out_s[rows], v_s[rows], b_t, run.slot, s)
        if plan.gathered_rows is not None:
            outs_g = out_gathered[:, lo:hi].split(sizes)
            vs_g = v_gathered[:, s * max_rank : (s + 1) * max_rank].split(sizes)
            for outs, vs, slot in zip(outs_g, vs_g, plan.gathered_slots, strict=True):
                expand_rows(outs, vs, b_t, slot, s)
    if plan.gathered_rows is not None:
        out.index_copy_(0, plan.gathered_rows, out_gathered)


def delta_planned(
    out: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    b: torch.Tensor,  # [slots, out_total, R]
    slot_scalings: torch.Tensor,  # float32 [slots, n_slices]
    slice_offsets: Sequence[int],
    plan: CpuOpPlan,
) -> None:
    """Shrink then expand by a plan made for these shapes (:func:`build_plan`). A plan whose every slot
    runs on the native kernels is one native call, with ``v`` in its scratch memory."""
    if plan.kernel is not None and not (plan.runs or plan.dense or plan.gathered_rows is not None):
        xc = x.contiguous()
        plan.kernel.lora_delta(
            _KERNEL_DTYPES[x.dtype],
            _raw(out),
            _raw(xc),
            xc.shape[1],
            _raw(a),
            _raw(b),
            _raw(slot_scalings),
            slice_offsets,
            threads=torch.get_num_threads(),
        )
        return
    if plan.runs:
        _runs_delta(out, x, a, b, slot_scalings, slice_offsets, plan)
        plan = plan._replace(runs=[])
        if plan.empty:
            return
    v = shrink_planned(x, a, len(slice_offsets) - 1, plan)
    expand_planned(out, v, b, slot_scalings, slice_offsets, plan)


def _runs_delta(
    out: torch.Tensor,  # [T, out_total], updated in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    b: torch.Tensor,  # [slots, out_total, R]
    slot_scalings: torch.Tensor,  # float32 [slots, n_slices]
    slice_offsets: Sequence[int],
    plan: CpuOpPlan,
) -> None:
    """The plan's runs (consecutive rows of one slot) on views of ``x`` and ``out``, in two phases:
    every run's shrink first (one native call for all of them where the plan has one and torch runs
    one thread, else GEMMs per run), then every run's expand (one native call where the plan has one
    and ``out`` is contiguous, else a GEMM per run and slice accumulating into ``out`` in place).

    Whole runs in two phases, not shrink and expand back to back per block of 128 rows: with a layer's
    ``x`` and ``out`` cold (as in a model), ``x`` then ``out`` are streamed in turn instead of
    alternately, and no GEMM repacks a slot's weights per block (BENCHMARKS.md, CPU ops). ``v`` is 64
    bytes a row at rank 16: keeping it between the phases costs nothing."""
    max_rank, n_slices = b.shape[2], len(slice_offsets) - 1
    # One thread only: there the native shrink measured clearly faster; at two threads, alternating
    # rounds on the loaded 2-core machine put it at 0.57-1.08x of the same path with BLAS's shrink
    # (medians) where BLAS's was 0.68-1.57x, so BLAS keeps those (BENCHMARKS.md, CPU ops).
    runs_shrink = plan.runs_shrink if torch.get_num_threads() == 1 else None
    runs_expand = plan.runs_expand if out.is_contiguous() else None
    if runs_shrink is None and runs_expand is None:
        shrunk = [_run_shrink_blas(x, a, n_slices, plan.ranks[run.slot], run) for run in plan.runs]
    else:
        v = x.new_zeros(x.shape[0], n_slices * max_rank)  # [T, n_slices * R]
        if runs_shrink is not None:
            xc = x.contiguous()
            runs_shrink.shrink(_KERNEL_DTYPES[x.dtype], _raw(xc), xc.shape[1], _raw(a), _raw(v), threads=1)
        else:
            for run in plan.runs:
                v_rows = v[run.start : run.start + run.size]
                _run_shrink_blas(x, a, n_slices, plan.ranks[run.slot], run, out=v_rows)
        if runs_expand is not None:
            runs_expand.expand(
                _KERNEL_DTYPES[out.dtype],
                _raw(out),
                _raw(v),
                _raw(b),
                _raw(slot_scalings),
                slice_offsets,
                threads=torch.get_num_threads(),
            )
            return
        shrunk = [v[run.start : run.start + run.size] for run in plan.runs]
    scalings = slot_scalings.tolist()
    reduced_precision = out.dtype != torch.float32
    for run, vs in zip(plan.runs, shrunk, strict=True):
        ranks, slot = plan.ranks[run.slot], run.slot
        rows = slice(run.start, run.start + run.size)
        for s, rank in enumerate(ranks):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            if not rank or lo == hi:
                continue
            v_s = vs[:, s * max_rank : s * max_rank + rank]
            b_s = b[slot, lo:hi, :rank].T  # [rank, width_s]
            outs = out[rows, lo:hi]
            if reduced_precision and run.size <= _FP32_PRODUCT_MAX_ROWS:
                outs.add_(torch.mm(v_s.float(), b_s.float()), alpha=scalings[slot][s])
            else:
                outs.addmm_(v_s, b_s, alpha=scalings[slot][s])


def _run_shrink_blas(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    n_slices: int,
    ranks: list[int],  # the run's slot's rank per slice
    run: _Run,
    out: torch.Tensor | None = None,  # [run.size, n_slices * R], zero
) -> torch.Tensor:
    """One run's shrink as BLAS GEMMs on a view of ``x``; returns its ``v`` ``[run.size, n_slices * R]``
    (``out`` when given: columns past a slice's rank are left as they are)."""
    max_rank = a.shape[1] // n_slices
    xs = x[run.start : run.start + run.size]
    if all(r == max_rank for r in ranks):
        return shrink_mm(xs, a[run.slot], out=out)
    vs = x.new_zeros(run.size, n_slices * max_rank) if out is None else out
    for s, rank in enumerate(ranks):
        if rank:
            cols = slice(s * max_rank, s * max_rank + rank)
            shrink_mm(xs, a[run.slot, cols], out=vs[:, cols])
    return vs


def shrink_mm(xs: torch.Tensor, a_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``xs @ a_rows^T``: ``[rows, in]`` by ``[columns, in]`` to ``[rows, columns]``, written to ``out``
    when given.

    A bf16 product of few columns over many rows is computed as ``(a_rows @ xs^T)^T``, the same sums
    (fp32 accumulation, one rounding) in the operand order for which oneDNN picks the faster kernel
    (``_BF16_TRANSPOSED_SHRINK_MAX_COLUMNS``); the result is then a transposed view, which the expand's
    GEMMs read as fast as a contiguous one."""
    rows, columns = xs.shape[0], a_rows.shape[0]
    if (
        xs.dtype == torch.bfloat16
        and columns <= _BF16_TRANSPOSED_SHRINK_MAX_COLUMNS
        and rows >= max(64, 4 * columns)
    ):
        product = torch.mm(a_rows, xs.T).T
        return product if out is None else out.copy_(product)
    if out is None:
        return torch.mm(xs, a_rows.T)
    return torch.mm(xs, a_rows.T, out=out)


def plan_for(meta: KernelMeta, n_tokens: int, max_rank: int, dtype: torch.dtype, kernel: bool) -> CpuOpPlan:
    """The plan of ``meta`` for these shapes, from the cache of plans by content (built on a miss)."""
    return _PLANS.get(meta, n_tokens, max_rank, dtype, kernel)
