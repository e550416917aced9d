"""The grouped torch path: one GEMM per (slot, slice) over contiguous row blocks, for CPU tensors.

Adjacent segments of one slot (the planner's chunks) are merged into one group. A group whose tokens
form long runs of consecutive tokens (prefill requests; any single decode token) is computed run by run
on views of ``x`` / ``v`` / ``out`` directly; the tokens of groups made of short runs (decode tokens of
one adapter spread over the batch) are gathered once, computed on contiguous views of the gathered
block, and written back once. Each GEMM's inner dimension is the slot's real rank, and the expand GEMM
accumulates into ``out`` in place (``addmm_``: fp32 accumulation, one rounding; a single bf16/fp16 row
is a product then an add, two roundings, because that is faster there). Nothing is done per
token in Python. It reads the segment arrays on the host: the ops run it for every device but CUDA
(where it would synchronise; ``benches/gpu_ops.py`` times it there as the baseline).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from lora_pin.ops._checks import OpArgumentError

__all__ = ["expand_grouped", "shrink_grouped"]

# A slot's rows that split into runs of consecutive tokens at least this long on average are computed
# run by run on views; shorter runs are gathered into one block instead. Measured (fp32, q/k/v of hidden
# 4096, rank 16, 4 slots x 8 runs of L tokens, 1 thread): gathering wins by 15-70% for L <= 8, they tie at
# 16, views win 2x at 32 and 3x at 64 (gathering copies out's rows twice).
_MIN_RUN = 16


class _Group(NamedTuple):
    """One GEMM's rows: a run of consecutive tokens, or a slot's block in the gathered rows."""

    slot: int
    size: int
    # First token of the run when the rows are consecutive tokens of the input, else -1.
    start: int
    # Offset of the group's rows in the gathered block (meaningful when start == -1).
    gathered_at: int


class _Plan(NamedTuple):
    groups: list[_Group]
    ranks: list[list[int]]
    # Token indices of the gathered block, in order; None when every group is a run.
    gathered_rows: torch.Tensor | None


def _plan(
    perm: torch.Tensor,  # int64 [N]
    seg_indptr: torch.Tensor,  # int32 [S + 1]
    seg_slots: torch.Tensor,  # int32 [S]
    slot_ranks: torch.Tensor,  # int32 [slots, n_slices]
    n_tokens: int,
    max_rank: int,
) -> _Plan:
    """Reads the segment arrays once and decides, per group, views or the gathered block."""
    indptr, seg_slot_list, ranks = seg_indptr.tolist(), seg_slots.tolist(), slot_ranks.tolist()
    n_rows, n_slots = perm.shape[0], len(ranks)
    if indptr[0] != 0 or indptr[-1] != n_rows or any(lo > hi for lo, hi in itertools.pairwise(indptr)):
        raise OpArgumentError(f"seg_indptr must rise from 0 to len(perm)={n_rows}, got {indptr}")
    if any(not 0 <= r <= max_rank for row in ranks for r in row):
        raise OpArgumentError(f"slot_ranks must lie in [0, max_rank={max_rank}], got {ranks}")
    if any(not -1 <= s < n_slots for s in seg_slot_list):
        raise OpArgumentError(f"seg_slots must lie in [-1, {n_slots}), got {seg_slot_list}")
    if n_rows:
        lowest, highest = torch.aminmax(perm)
        if int(lowest) < 0 or int(highest) >= n_tokens:
            raise OpArgumentError(f"perm holds tokens outside [0, {n_tokens}): {int(lowest)}..{int(highest)}")

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
        return _Plan([], ranks, None)

    # Cut every span into runs of consecutive tokens. Runs long enough for a GEMM to pay become views
    # (no copy); a span of short runs (decode tokens of one adapter spread over the batch) is gathered.
    breaks = torch.ones(n_rows, dtype=torch.bool, device=perm.device)
    torch.ne(perm[1:], perm[:-1] + 1, out=breaks[1:])
    run_starts = torch.nonzero(breaks).flatten()
    starts, start_tokens = torch.stack([run_starts, perm[run_starts]]).tolist()

    groups, gathered_spans, gathered = [], [], 0
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
                groups.append(_Group(slot, cut_hi - cut_lo, token, 0))
        else:
            groups.append(_Group(slot, hi - lo, -1, gathered))
            gathered_spans.append((lo, hi))
            gathered += hi - lo
    if not gathered_spans:
        rows = None
    elif gathered == n_rows:
        rows = perm
    else:
        rows = torch.cat([perm[lo:hi] for lo, hi in gathered_spans])
    return _Plan(groups, ranks, rows)


def shrink_grouped(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, n_slices * R, in]
    perm: torch.Tensor,  # int64 [N]
    seg_indptr: torch.Tensor,  # int32 [S + 1]
    seg_slots: torch.Tensor,  # int32 [S]
    slot_ranks: torch.Tensor,  # int32 [slots, n_slices]
    n_slices: int,
) -> torch.Tensor:
    """:func:`lora_pin.ops.shrink` on CPU; arguments already checked by ``check_shrink_args``."""
    max_rank = a.shape[1] // n_slices
    v = x.new_zeros(x.shape[0], n_slices * max_rank)  # [T, n_slices * R]
    plan = _plan(perm, seg_indptr, seg_slots, slot_ranks, x.shape[0], max_rank)
    if plan.gathered_rows is not None:
        x_gathered = x.index_select(0, plan.gathered_rows)
        v_gathered = x.new_zeros(plan.gathered_rows.shape[0], n_slices * max_rank)
    a_t = a.transpose(1, 2)  # [slots, in, n_slices * R]; views are made once per call, not per group
    for g in plan.groups:
        if g.start >= 0:
            xs, vs = x[g.start : g.start + g.size], v[g.start : g.start + g.size]
        else:
            xs, vs = (
                x_gathered[g.gathered_at : g.gathered_at + g.size],
                v_gathered[g.gathered_at : g.gathered_at + g.size],
            )
        ranks = plan.ranks[g.slot]
        if all(r == max_rank for r in ranks):
            torch.mm(xs, a_t[g.slot], out=vs)
            continue
        for s, rank in enumerate(ranks):
            if rank:
                cols = slice(s * max_rank, s * max_rank + rank)
                torch.mm(xs, a_t[g.slot, :, cols], out=vs[:, cols])
    if plan.gathered_rows is not None:
        v.index_copy_(0, plan.gathered_rows, v_gathered)
    return v


def expand_grouped(
    out: torch.Tensor,  # [T, out_total], updated in place
    v: torch.Tensor,  # [T, n_slices * R]
    b: torch.Tensor,  # [slots, out_total, R]
    perm: torch.Tensor,  # int64 [N]
    seg_indptr: torch.Tensor,  # int32 [S + 1]
    seg_slots: torch.Tensor,  # int32 [S]
    slot_ranks: torch.Tensor,  # int32 [slots, n_slices]
    slot_scalings: torch.Tensor,  # float32 [slots, n_slices]
    slice_offsets: Sequence[int],  # n_slices + 1 ints
) -> None:
    """:func:`lora_pin.ops.expand` on CPU; arguments already checked by ``check_expand_args``."""
    max_rank = b.shape[2]
    n_slices = len(slice_offsets) - 1
    plan = _plan(perm, seg_indptr, seg_slots, slot_ranks, out.shape[0], max_rank)
    scalings = slot_scalings.tolist()
    if plan.gathered_rows is not None:
        out_gathered = out.index_select(0, plan.gathered_rows)
        v_gathered = v.index_select(0, plan.gathered_rows)
    # Per-slice views, made once per call: the loop below then slices each only once.
    live = [s for s in range(n_slices) if slice_offsets[s + 1] > slice_offsets[s]]
    widths = {s: slice(slice_offsets[s], slice_offsets[s + 1]) for s in live}
    b_t = {s: b[:, widths[s]].transpose(1, 2) for s in live}  # [slots, R, width_s]
    out_s = {s: out[:, widths[s]] for s in live}
    v_s = {s: v[:, s * max_rank : (s + 1) * max_rank] for s in live}
    if plan.gathered_rows is not None:
        out_gathered_s = {s: out_gathered[:, widths[s]] for s in live}
        v_gathered_s = {s: v_gathered[:, s * max_rank : (s + 1) * max_rank] for s in live}
    # A one-row bf16/fp16 addmm_ with K = rank pays a large fixed cost on CPU; a product then an add is
    # ~20% faster there, and slower in fp32 or with more rows (measured: benches/cpu_ops.py --dtype bf16).
    reduced_precision = out.dtype != torch.float32
    for g in plan.groups:
        ranks, slot_scaling = plan.ranks[g.slot], scalings[g.slot]
        product_then_add = reduced_precision and g.size == 1
        if g.start >= 0:
            rows, outs, vs = slice(g.start, g.start + g.size), out_s, v_s
        else:
            rows, outs, vs = slice(g.gathered_at, g.gathered_at + g.size), out_gathered_s, v_gathered_s
        for s in live:
            rank = ranks[s]
            if not rank:
                continue
            if product_then_add:
                delta = torch.mm(vs[s][rows, :rank], b_t[s][g.slot, :rank])
                outs[s][rows].add_(delta, alpha=slot_scaling[s])
            else:
                outs[s][rows].addmm_(vs[s][rows, :rank], b_t[s][g.slot, :rank], alpha=slot_scaling[s])
    if plan.gathered_rows is not None:
        out.index_copy_(0, plan.gathered_rows, out_gathered)
