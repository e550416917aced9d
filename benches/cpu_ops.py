"""CPU benchmark: lora_pin's LoRA delta against the ways peers run mixed-adapter batches on a CPU.

Baselines, run in the same process on the same tensors, each written from a description of the peer's
CPU path (not from its code):

- ``peft``: PEFT's mixed-batch forward (``adapter_names=[...]``): per LoRA module (here each slice), per
  distinct adapter, Python index lists, gather, ``lora_A``, ``lora_B``, scale, add back.
- ``gather-bmm``: gather every token's A and B from the stacked pool (padded to the max rank), then two
  batched matmuls (punica's and S-LoRA's "gather" baseline).
- ``vllm``: vLLM's CPU SGMV (its torch ops behind the CPU punica wrapper): segments expanded to one
  adapter index per token, then per slice a per-token gather of that slice's A, a batched product
  (``einsum``) scaled into ``v``, a per-token gather of the slice's B and a second batched product
  added into the slice's columns.
- ``sglang``: SGLang's torch-native LoRA backend: a loop over the batch's request segments in request
  order (unsorted by adapter), one ``einsum`` with the request's stacked A (the scaling applied to its
  r-wide output) and one per slice with its B added into the output; a batch of one adapter is one
  segment of every row.

``lora_pin`` is timed as a model layer runs it on the CPU: the step's delta for the layer group checked
and planned once (:meth:`lora_pin.ops.backends.cpu.CpuDelta.prepare`, shared by every layer of the
group, so not timed here) and applied per call. Every case is checked against the baselines before it
is timed.

Timing: methods take turns in every round, in an order that rotates from round to round, with a buffer
larger than the last-level cache written before every call (each call starts cold, as a layer's
adapter weights do in a model); the figure is the median over the rounds. ``--caches warm`` instead runs
each call once, untimed, right before its timed call (weights and activations in cache as far as they
fit: a small model, or a layer called twice). Every case runs at each thread count in ``--threads``
(``torch.set_num_threads``), and the native kernels use as many.

``--layout pages`` instead compares the rank-paged pool (issue 37) with the slot layout on the same
weights: per case, the slot layout's ``shrink`` + ``expand`` ops against ``paged_shrink`` +
``paged_expand`` on the same adapters copied into pages of ``--page-rank`` (scattered, as a pool's
pages are), both checked against the fp64 reference; the ratio is slots / pages (the goal: >= 0.97x
in every case); ``--stat min`` compares the fastest round of each instead of the median. Mixed ranks
(``--ranks 8,8,8,8,16,16,64``) pad every slot to the largest rank in the slot layout, not in pages.
``--path layer`` times both layouts as a model layer runs them on the CPU instead of the ops:
``CpuBackend.add_lora_linear`` over one step, whose kernel state checks and plans the group on its
first call (untimed: the check against the reference makes it), later calls running the plan.

The fixed costs of a layer call are printed first, with their breakdown (see :func:`fixed_costs`), and
an embedding's (:func:`embedding_fixed_costs`).

    python benches/cpu_ops.py                               # fp32 and bf16, 1 and 2 threads
    python benches/cpu_ops.py --dtype bf16 --threads 2      # one part of it
    python benches/cpu_ops.py --caches cold,warm --hidden 2048 --layers plain --adapters 8 \
        --phases decode --patterns distinct --dtype fp32 --threads 1   # one case, both cache states
    python benches/cpu_ops.py --layout pages --fixed-calls 0 --ranks 8,8,8,8,16,16,64   # paged vs slots
    python benches/cpu_ops.py --layout pages --path layer --fixed-calls 0 --ranks 8,8,8,8,16,16,64
    python benches/cpu_ops.py --help
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lora_pin._testing import StackedLayer, random_layer, request_slots
from lora_pin.model.layers import LoRAEmbedding, LoRALinear
from lora_pin.model.segments import StepSegments
from lora_pin.ops import (
    KernelMeta,
    embedding_delta_,
    expand,
    grouped,
    lora_delta_,
    paged_expand,
    paged_shrink,
    segments_from_slots,
    shrink,
)
from lora_pin.ops.backends.cpu import CpuBackend, CpuDelta, CpuEmbeddingDelta
from lora_pin.ops.paged import pages_from_slots

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PATTERNS = ("distinct", "uniform", "zipf", "identical")
BASELINES = ("peft", "gather-bmm", "vllm", "sglang")


@dataclass(frozen=True)
class Case:
    layer: str  # "qkv" (fused q/k/v under GQA) or "plain" (one slice)
    n_slots: int  # adapters to draw from
    pattern: str
    phase: str  # "decode" (1 token per request) or "prefill"
    n_requests: int
    tokens_per_request: int


def peft_mixed_batch(
    out: torch.Tensor, x: torch.Tensor, adapter_names: list[int], layer: StackedLayer
) -> None:
    """PEFT's ``LoraLayer._mixed_batch_forward``, step for step, less the base layer (a module per slice)."""
    max_rank = layer.b.shape[2]
    ranks, scalings = layer.slot_ranks.tolist(), layer.slot_scalings.tolist()
    for s in range(len(layer.slice_offsets) - 1):
        result = out[:, layer.slice_offsets[s] : layer.slice_offsets[s + 1]]
        unique_adapters = set(adapter_names)
        sub_batch_indices_list = [
            [index for index, item in enumerate(adapter_names) if item == adapter]
            for adapter in unique_adapters
        ]
        for i, adapter in enumerate(unique_adapters):
            if adapter < 0:
                continue
            rank = ranks[adapter][s]
            lora_a = layer.a[adapter, s * max_rank : s * max_rank + rank]
            lora_b = layer.b[adapter, layer.slice_offsets[s] : layer.slice_offsets[s + 1], :rank]
            sub_batch = x[sub_batch_indices_list[i]]
            lora_output = F.linear(F.linear(sub_batch, lora_a), lora_b) * scalings[adapter][s]
            result[sub_batch_indices_list[i]] += lora_output


def gather_bmm(out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, layer: StackedLayer) -> None:
    """Gather each token's weights (padded to the max rank), then batched matmuls."""
    max_rank = layer.b.shape[2]
    rows = (token_slots >= 0).nonzero().squeeze(1)
    slots = token_slots[rows]
    v = torch.bmm(layer.a[slots], x[rows].unsqueeze(2))  # [N, n_slices * R, 1]
    b_tokens = layer.b[slots]  # [N, out_total, R]
    scalings = layer.slot_scalings[slots].to(x.dtype)  # [N, n_slices]
    for s in range(len(layer.slice_offsets) - 1):
        lo, hi = layer.slice_offsets[s], layer.slice_offsets[s + 1]
        delta = torch.bmm(b_tokens[:, lo:hi], v[:, s * max_rank : (s + 1) * max_rank]).squeeze(2)
        out[rows, lo:hi] += delta * scalings[:, s : s + 1]


def vllm_sgmv(
    out: torch.Tensor, x: torch.Tensor, segments: tuple[torch.Tensor, ...], layer: StackedLayer
) -> None:
    """vLLM's CPU SGMV as described: per-token adapter indices from the segments, then per slice a
    per-token weight gather and batched products (shrink scaled into ``v``, expand added into ``out``)."""
    perm, seg_indptr, seg_slots = segments[:3]
    max_rank = layer.b.shape[2]
    token_slots = torch.repeat_interleave(seg_slots.long(), (seg_indptr[1:] - seg_indptr[:-1]).long())
    rows, slots = perm, token_slots
    xs = x.index_select(0, rows)
    for s in range(len(layer.slice_offsets) - 1):
        lo, hi = layer.slice_offsets[s], layer.slice_offsets[s + 1]
        a_tokens = layer.a[:, s * max_rank : (s + 1) * max_rank][slots]  # [N, R, in]
        scale = layer.slot_scalings[slots, s].unsqueeze(1).to(x.dtype)
        v = torch.einsum("bi,boi->bo", xs, a_tokens) * scale  # [N, R]
        b_tokens = layer.b[:, lo:hi][slots]  # [N, width, R]
        delta = torch.einsum("bi,boi->bo", v, b_tokens)
        out[:, lo:hi].index_add_(0, rows, delta)


def sglang_segments(
    out: torch.Tensor, x: torch.Tensor, request_slots: list[int], tokens_per_request: int, layer: StackedLayer
) -> None:
    """SGLang's torch-native backend as described: a batch of one adapter is one shrink ``einsum`` over
    every row and one expand per slice; otherwise, per request segment (in request order), one ``einsum``
    with the request's stacked A scaled in the batch's dtype, then one ``einsum`` per slice with its B
    added to the output."""
    max_rank = layer.b.shape[2]
    n_slices = len(layer.slice_offsets) - 1
    scalings = layer.slot_scalings.tolist()
    if len(set(request_slots)) == 1 and request_slots[0] >= 0:
        segments = [(request_slots[0], 0, len(request_slots) * tokens_per_request)]
    else:
        segments = [
            (slot, i * tokens_per_request, (i + 1) * tokens_per_request)
            for i, slot in enumerate(request_slots)
            if slot >= 0
        ]
    for slot, lo_row, hi_row in segments:
        v = torch.einsum("si,oi->so", x[lo_row:hi_row], layer.a[slot])  # [len, n_slices * R]
        for s in range(n_slices):
            v[:, s * max_rank : (s + 1) * max_rank] *= scalings[slot][s]
        for s in range(n_slices):
            lo, hi = layer.slice_offsets[s], layer.slice_offsets[s + 1]
            b_s = layer.b[slot, lo:hi]  # [width, R]
            out[lo_row:hi_row, lo:hi] += torch.einsum(
                "si,oi->so", v[:, s * max_rank : (s + 1) * max_rank], b_s
            )


def fp64_reference(
    out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, layer: StackedLayer
) -> torch.Tensor:
    """``out`` plus every token's delta in float64, from the per-token slot map (no segment arrays, no
    rounding): per slot and slice, ``scaling * (x_rows @ A_sᵀ) @ B_sᵀ``."""
    want = out.double()
    max_rank = layer.b.shape[2]
    ranks, scalings = layer.slot_ranks.tolist(), layer.slot_scalings.tolist()
    for slot in sorted(set(token_slots.tolist()) - {-1}):
        rows = (token_slots == slot).nonzero().squeeze(1)
        xs = x[rows].double()
        for s in range(len(layer.slice_offsets) - 1):
            rank = ranks[slot][s]
            if rank:
                lo, hi = layer.slice_offsets[s], layer.slice_offsets[s + 1]
                a_s = layer.a[slot, s * max_rank : s * max_rank + rank].double()
                b_s = layer.b[slot, lo:hi, :rank].double()
                want[rows, lo:hi] += scalings[slot][s] * ((xs @ a_s.T) @ b_s.T)
    return want


def time_rounds(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    flush: torch.Tensor | None,
    slow_s: float = 0.3,
    stat: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """Median (or ``stat``) seconds of one call of each, over interleaved rounds with the order rotating
    every round and ``flush`` written before every call (each call starts with cold caches), or, with
    ``flush`` None, the call run once untimed right before (it starts with its own inputs and weights in
    cache, as far as they fit). A method whose warm-up call took over ``slow_s`` (a baseline gathering
    every token's weights in prefill) runs in 3 rounds only."""
    slow = set()
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        if time.perf_counter() - start > slow_s:
            slow.add(name)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if name in slow and len(samples[name]) >= 3:
                continue
            samples[name].append(_timed_call(fns[name], flush))
    return {name: stat(times) for name, times in samples.items()}


def _timed_call(fn: Callable[[], object], flush: torch.Tensor | None) -> float:
    """Seconds of one call of ``fn``, after writing ``flush`` (cold caches) or, with ``flush`` None, after
    one untimed call (warm)."""
    if flush is None:
        fn()
    else:
        flush.add_(1)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_ratio(fns: Mapping[str, Callable[[], object]], rounds: int, flush: torch.Tensor | None) -> float:
    """The median over ``rounds`` of the first method's seconds over the second's, timed back to back in
    each round (the order rotating every round, ``flush`` written before every call as in
    :func:`time_rounds`): each ratio compares two calls a few milliseconds apart, so what a shared
    machine's neighbours add for longer than that cancels out of it."""
    first, second = list(fns)
    ratios = []
    for r in range(rounds):
        times = {
            name: _timed_call(fns[name], flush)
            for name in ((first, second) if r % 2 == 0 else (second, first))
        }
        ratios.append(times[first] / times[second])
    return statistics.median(ratios)


def cases(args: argparse.Namespace) -> list[Case]:
    out = []
    for layer in args.layers:
        for n_slots in args.adapters:
            for phase, n_requests, tokens in (
                ("decode", args.decode_batch, 1),
                ("prefill", args.prefill_requests, args.prefill_tokens),
            ):
                if phase not in args.phases:
                    continue
                for pattern in args.patterns:
                    out.append(Case(layer, n_slots, pattern, phase, n_requests, tokens))
    return out


def slice_widths(layer: str, hidden: int) -> list[int]:
    return [hidden, hidden // 4, hidden // 4] if layer == "qkv" else [hidden]


def run_case(
    case: Case, dtype: torch.dtype, args: argparse.Namespace, gen: torch.Generator
) -> dict[str, float | int | str]:
    layer = random_layer(
        case.n_slots, args.hidden, slice_widths(case.layer, args.hidden), args.ranks, dtype, gen
    )
    req_slots = request_slots(case.pattern, case.n_requests, case.n_slots, gen)
    token_slots = torch.repeat_interleave(req_slots, case.tokens_per_request)
    n_tokens = token_slots.shape[0]
    x = torch.randn(n_tokens, args.hidden, generator=gen).to(dtype)
    out0 = torch.randn(n_tokens, layer.slice_offsets[-1], generator=gen).to(dtype)
    segments = segments_from_slots(token_slots, args.chunk_size)
    delta = CpuDelta.prepare(layer.meta(segments), layer.a, layer.b, n_tokens)
    adapter_names, slot_list = token_slots.tolist(), req_slots.tolist()
    methods: dict[str, Callable[[torch.Tensor], object]] = {
        "peft": lambda o: peft_mixed_batch(o, x, adapter_names, layer),
        "gather-bmm": lambda o: gather_bmm(o, x, token_slots, layer),
        "vllm": lambda o: vllm_sgmv(o, x, tuple(segments[:3]), layer),
        "sglang": lambda o: sglang_segments(o, x, slot_list, case.tokens_per_request, layer),
        "lora_pin": lambda o: delta.apply(o, x),
    }
    results = {}
    for name, fn in methods.items():
        got = out0.clone()
        fn(got)
        results[name] = got.float()
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for name in BASELINES:
        err = (results[name] - results["lora_pin"]).abs().max().item()
        if err > tol * max(1.0, results[name].abs().max().item()):
            raise AssertionError(f"{case}: lora_pin and {name} disagree by {err}")
    want = fp64_reference(out0, x, token_slots, layer)
    scale = want.abs().max().item()
    errors = {name: (got.double() - want).abs().max().item() / scale for name, got in results.items()}
    row: dict[str, float | int | str] = {
        "layer": case.layer,
        "slots": case.n_slots,
        "pattern": case.pattern,
        "phase": case.phase,
        "tokens": n_tokens,
        "adapters": len(set(slot_list) - {-1}),
    }
    row["err lora_pin"] = errors["lora_pin"]
    row["err baselines"] = min(errors[name] for name in BASELINES)
    scratch = {name: out0.clone() for name in methods}
    timed = {name: (lambda fn=fn, o=scratch[name]: fn(o)) for name, fn in methods.items()}
    row.update(time_rounds(timed, args.rounds, args.flush if args.cache == "cold" else None))
    return row


_STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min, "paired": min}
#: The paged layout's goal against the slot layout, per case (issue 37): no slower beyond noise.
PAGES_GOAL = 0.97


def run_pages_case(
    case: Case, dtype: torch.dtype, args: argparse.Namespace, gen: torch.Generator
) -> dict[str, float | int | str]:
    """One case in both layouts on the same adapters: the slot layout's ops against the paged ones."""
    layer = random_layer(
        case.n_slots, args.hidden, slice_widths(case.layer, args.hidden), args.ranks, dtype, gen
    )
    a_pages, b_pages, pages = pages_from_slots(
        layer.a, layer.b, layer.slot_ranks, args.page_rank, generator=gen
    )
    req_slots = request_slots(case.pattern, case.n_requests, case.n_slots, gen)
    token_slots = torch.repeat_interleave(req_slots, case.tokens_per_request)
    n_tokens = token_slots.shape[0]
    x = torch.randn(n_tokens, args.hidden, generator=gen).to(dtype)
    out0 = torch.randn(n_tokens, layer.slice_offsets[-1], generator=gen).to(dtype)
    segments = segments_from_slots(token_slots, args.chunk_size)
    meta = layer.meta(segments)
    max_rank = layer.a.shape[1] // meta.n_slices
    methods: dict[str, Callable[[torch.Tensor], object]]
    if args.path == "layer":
        methods = {
            "slot layout": layer_call(layer, layer.a, layer.b, x, StepSegments(segments=segments)),
            "paged": layer_call(
                layer, a_pages, b_pages, x, StepSegments(segments=segments, pages=pages), args.page_rank
            ),
        }
    else:
        methods = {
            "slot layout": lambda o: expand(o, shrink(x, layer.a, meta), layer.b, meta),
            "paged": lambda o: paged_expand(
                o, paged_shrink(x, a_pages, pages, meta, max_rank), b_pages, pages, meta
            ),
        }
    want = fp64_reference(out0, x, token_slots, layer)
    scale = want.abs().max().item()
    row: dict[str, float | int | str] = {
        "layer": case.layer,
        "slots": case.n_slots,
        "pattern": case.pattern,
        "phase": case.phase,
        "tokens": n_tokens,
        "adapters": len(set(req_slots.tolist()) - {-1}),
    }
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for name, fn in methods.items():
        got = out0.clone()
        fn(got)
        row[f"err {name}"] = err = (got.double() - want).abs().max().item() / scale
        if err > tol:
            raise AssertionError(f"{case}: {name} is off the fp64 reference by {err}")
    scratch = {name: out0.clone() for name in methods}
    timed = {name: (lambda fn=fn, o=scratch[name]: fn(o)) for name, fn in methods.items()}
    flush = args.flush if args.cache == "cold" else None
    row.update(time_rounds(timed, args.rounds, flush, stat=_STATS[args.stat]))
    if args.stat == "paired":
        row["ratio"] = paired_ratio(timed, args.rounds, flush)
    return row


def layer_call(
    layer: StackedLayer,
    a: torch.Tensor,
    b: torch.Tensor,
    x: torch.Tensor,
    step: StepSegments,
    page_rank: int | None = None,
) -> Callable[[torch.Tensor], object]:
    """``out += delta(x)`` as a model layer runs it on the CPU: one backend and one step for every call,
    over ``a`` / ``b`` (a slot pool's, or with ``page_rank`` a paged pool's)."""
    n_slices = len(layer.slice_offsets) - 1
    buffers = types.SimpleNamespace(
        group=types.SimpleNamespace(n_slices=n_slices, key="layer"),
        a=a,
        b=b,
        ranks=layer.slot_ranks,
        scalings=layer.slot_scalings,
        slice_offsets=layer.slice_offsets,
        dora_slots=None,
        page_rank=page_rank,
        max_rank=layer.a.shape[1] // n_slices,
    )
    backend, offsets = CpuBackend(), list(layer.slice_offsets)
    return lambda o: backend.add_lora_linear(step, buffers, o, x, offsets, lambda: None)  # type: ignore[arg-type]


def pages_header(threads: int, dtype: str, cache: str, page_rank: int, stat: str) -> None:
    print(
        f"\n{dtype}, {threads} thread{'s' if threads > 1 else ''}, {cache} caches, page_rank {page_rank} "
        f"({stat} ms; ratio = slots / pages)"
    )
    header = (
        f"{'layer':5} {'slots':>5} {'phase':7} {'pattern':9} {'tok':>4} {'ad':>3} "
        f"{'slots':>9}{'pages':>9}{'ratio':>8} {'goal':>5}{'err slots':>10}{'err pages':>10}"
    )
    print(header)
    print("-" * len(header))


def print_pages_row(r: Mapping[str, float | int | str]) -> bool:
    """Prints one case of ``--layout pages``; returns whether the paged layout met its goal there."""
    slots, pages = float(r["slot layout"]), float(r["paged"])
    ratio = float(r.get("ratio", slots / pages))
    met = ratio >= PAGES_GOAL
    print(
        f"{r['layer']:5} {r['slots']:>5} {r['phase']:7} {r['pattern']:9} {r['tokens']:>4} {r['adapters']:>3} "
        f"{slots * 1e3:>9.3f}{pages * 1e3:>9.3f}{ratio:>7.2f}x {'ok' if met else 'MISS':>5}"
        f"{float(r['err slot layout']):>10.1e}{float(r['err paged']):>10.1e}",
        flush=True,
    )
    return met


def goal_of(row: Mapping[str, float | int | str], threads: int) -> tuple[float, float, bool]:
    """``(ratio to the best baseline, the ratio needed, met)`` for one row."""
    best = min(float(row[name]) for name in BASELINES)
    ratio = best / float(row["lora_pin"])
    mixed = row["phase"] == "decode" and row["pattern"] != "identical" and int(row["slots"]) == 64
    needed = 1.3 if threads == 2 and mixed else 1.0
    return ratio, needed, ratio >= needed


def table_header(threads: int, dtype: str, cache: str) -> None:
    print(
        f"\n{dtype}, {threads} thread{'s' if threads > 1 else ''}, {cache} caches "
        "(median ms; ratios = baseline / lora_pin)"
    )
    header = (
        f"{'layer':5} {'slots':>5} {'phase':7} {'pattern':9} {'tok':>4} {'ad':>3} "
        + "".join(f"{name:>10}" for name in (*BASELINES, "lora_pin"))
        + "".join(f"{name + '/x':>12}" for name in BASELINES)
        + f"{'best/x':>8} {'goal':>5}"
        + f"{'err':>9} {'err base':>9}"
    )
    print(header)
    print("-" * len(header))


def print_row(r: Mapping[str, float | int | str], threads: int) -> bool:
    """Prints one case; returns whether lora_pin met its goal there."""
    ours = float(r["lora_pin"])
    ratio, needed, met = goal_of(r, threads)
    print(
        f"{r['layer']:5} {r['slots']:>5} {r['phase']:7} {r['pattern']:9} "
        f"{r['tokens']:>4} {r['adapters']:>3} "
        + "".join(f"{float(r[name]) * 1e3:>10.3f}" for name in (*BASELINES, "lora_pin"))
        + "".join(f"{float(r[name]) / ours:>11.2f}x" for name in BASELINES)
        + f"{ratio:>7.2f}x {'ok' if met else 'MISS':>5}"
        + f"{float(r['err lora_pin']):>9.1e} {float(r['err baselines']):>9.1e}"
        + ("" if needed == 1.0 else f" (>= {needed}x)"),
        flush=True,
    )
    return met


class _Output(torch.nn.Module):
    """A base layer that returns a ready output: a LoRALinear around it costs only its LoRA work."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


def _per_call(fn: Callable[[], object], calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``calls`` calls."""
    for _ in range(calls // 10 + 1):
        fn()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


def fixed_costs(calls: int) -> dict[str, float]:
    """Microseconds of a LoRA layer call whose kernels have next to nothing to do (4 tokens, hidden 64,
    fused q/k/v, rank 16, fp32), through :class:`LoRALinear` as a model runs it, less the wrapped base
    layer's own call; and the parts of it, each timed alone. ``before`` is the same call through the
    unprepared ops (``shrink`` then ``expand`` with the step's :class:`KernelMeta`), what a layer did
    before the per-step preparation."""
    gen = torch.Generator().manual_seed(0)
    layer = random_layer(8, 64, [64, 16, 16], [16], torch.float32, gen)
    x, out = torch.randn(4, 64, generator=gen), torch.randn(4, 96, generator=gen)
    group = types.SimpleNamespace(n_slices=3, key="qkv")
    buffers = types.SimpleNamespace(
        group=group,
        a=layer.a,
        b=layer.b,
        ranks=layer.slot_ranks,
        scalings=layer.slot_scalings,
        slice_offsets=layer.slice_offsets,
        dora_slots=None,  # no DoRA adapter in these slots
        page_rank=None,  # a slot pool
    )
    used = segments_from_slots(torch.tensor([0, -1, 1, 0]))
    # Slot 2 has no rank in this group (an adapter that targets other modules only).
    ranks_elsewhere = layer.slot_ranks.clone()
    ranks_elsewhere[2] = 0
    unused_buffers = types.SimpleNamespace(**{**vars(buffers), "ranks": ranks_elsewhere})
    unused = segments_from_slots(torch.tensor([2, -1, 2, -1]))

    def layer_for(segs: object, bufs: object) -> Callable[[], object]:
        step = StepSegments(segments=segs, any_adapter=True)  # type: ignore[arg-type]
        module = LoRALinear(_Output(out), bufs, lambda: step)  # type: ignore[arg-type]
        return lambda: module(x)

    idle = LoRALinear(_Output(out), buffers, lambda: None)  # type: ignore[arg-type]
    meta = KernelMeta.for_layer(used, layer.slot_ranks, layer.slot_scalings, layer.slice_offsets)
    delta = CpuDelta.prepare(meta, layer.a, layer.b, 4)
    kernel = delta.plan.kernel
    with torch.inference_mode():
        base = _per_call(lambda: idle(x), calls)
        figures = {
            "layer, no row uses the group": _per_call(layer_for(unused, unused_buffers), calls) - base,
            "layer, adapter rows": _per_call(layer_for(used, buffers), calls) - base,
            "  apply (checks + kernels)": _per_call(lambda: delta.apply(out, x), calls),
            "  kernels (one native call)": _per_call(
                lambda: grouped.delta_planned(
                    out, x, layer.a, layer.b, layer.slot_scalings, delta.offsets, delta.plan
                ),
                calls,
            )
            if kernel is not None
            else float("nan"),
            "prepare, once per step and group": _per_call(
                lambda: CpuDelta.prepare(meta, layer.a, layer.b, 4), max(calls // 10, 10)
            ),
            "the fused op checked in full, unprepared": _per_call(
                lambda: lora_delta_(out, x, layer.a, layer.b, meta), calls
            ),
            "before: shrink + expand ops, unprepared": _per_call(
                lambda: expand(out, shrink(x, layer.a, meta), layer.b, meta), calls
            ),
        }
    return {name: seconds * 1e6 for name, seconds in figures.items()}


def embedding_fixed_costs(calls: int) -> dict[str, float]:
    """Microseconds of an embedding's LoRA work in one call whose kernels have next to nothing to do
    (4 tokens, vocabulary 64, dim 64, rank 16, fp32), through :class:`LoRAEmbedding` as a model runs
    it, less the base embedding's own call; and its parts. ``before`` is the lookup then the
    ``lora_pin::expand`` op, what the layer did before its per-step preparation."""
    gen = torch.Generator().manual_seed(1)
    layer = random_layer(8, 64, [64], [16], torch.float32, gen)
    base = torch.nn.Embedding(64, 64)
    ids = torch.randint(0, 64, (4,), generator=gen)
    buffers = types.SimpleNamespace(
        group=types.SimpleNamespace(n_slices=1, key="embed_tokens"),
        a=layer.a,
        b=layer.b,
        ranks=layer.slot_ranks,
        scalings=layer.slot_scalings,
        slice_offsets=layer.slice_offsets,
        dora_slots=None,
        page_rank=None,
    )
    used = segments_from_slots(torch.tensor([0, -1, 1, 0]))
    ranks_elsewhere = layer.slot_ranks.clone()
    ranks_elsewhere[2] = 0  # an adapter without weights on the embedding
    unused_buffers = types.SimpleNamespace(**{**vars(buffers), "ranks": ranks_elsewhere})
    unused = segments_from_slots(torch.tensor([2, -1, 2, -1]))

    def layer_for(segs: object, bufs: object) -> Callable[[], object]:
        step = StepSegments(segments=segs, any_adapter=True)  # type: ignore[arg-type]
        module = LoRAEmbedding(base, bufs, lambda: step)  # type: ignore[arg-type]
        return lambda: module(ids)

    idle = LoRAEmbedding(base, buffers, lambda: None)  # type: ignore[arg-type]
    meta = KernelMeta.for_layer(used, layer.slot_ranks, layer.slot_scalings, layer.slice_offsets)
    delta = CpuEmbeddingDelta.prepare(meta, layer.a, layer.b, 4)
    out = torch.randn(4, 64, generator=gen)

    def before() -> None:
        # The layer's CPU path before: the rows' slots, the lookup, then the expand op checked in full.
        counts = (meta.seg_indptr[1:] - meta.seg_indptr[:-1]).long()
        row_slots = torch.repeat_interleave(meta.seg_slots.long().clamp_min(0), counts)
        v = out.new_zeros(4, 16)
        v.index_copy_(0, meta.perm, layer.a[row_slots, :, ids.index_select(0, meta.perm)])
        expand(out, v, layer.b, meta)

    with torch.inference_mode():
        base_call = _per_call(lambda: idle(ids), calls)
        figures = {
            "embedding, no row uses the group": _per_call(layer_for(unused, unused_buffers), calls)
            - base_call,
            "embedding, adapter rows": _per_call(layer_for(used, buffers), calls) - base_call,
            "  apply (checks + lookup + kernels)": _per_call(lambda: delta.apply(out, ids), calls),
            "  the op checked in full, unprepared": _per_call(
                lambda: embedding_delta_(out, ids, layer.a, layer.b, meta), calls
            ),
            "prepare, once per step": _per_call(
                lambda: CpuEmbeddingDelta.prepare(meta, layer.a, layer.b, 4), max(calls // 10, 10)
            ),
            "before: lookup + expand op, unprepared": _per_call(before, calls),
        }
    return {name: seconds * 1e6 for name, seconds in figures.items()}


def copy_bandwidth() -> float:
    """Bytes per second of a 256 MiB copy (read + write), best of 5."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--hidden", type=int, default=4096, help="input features (qkv: q is as wide, k and v 1/4)"
    )
    parser.add_argument(
        "--layers", type=lambda s: s.split(","), default=["qkv", "plain"], help="qkv and/or plain"
    )
    parser.add_argument("--adapters", type=_ints, default=[8, 64], help="adapter counts (slots) to draw from")
    parser.add_argument("--ranks", type=_ints, default=[16], help="ranks cycled over slots")
    parser.add_argument(
        "--dtype", type=lambda s: s.split(","), default=["fp32", "bf16"], help="fp32,bf16,fp16"
    )
    parser.add_argument("--threads", type=_ints, default=[1, 2], help="torch (and kernel) thread counts")
    parser.add_argument(
        "--decode-batch", type=int, default=64, help="requests in a decode step (1 token each)"
    )
    parser.add_argument("--prefill-requests", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=128, help="tokens per prefill request")
    parser.add_argument("--chunk-size", type=int, default=16, help="segment chunk size, as the planner cuts")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per case (median reported)")
    parser.add_argument("--fixed-calls", type=int, default=2000, help="calls per repeat of the fixed costs")
    parser.add_argument("--flush-mb", type=int, default=128, help="buffer written before each timed call")
    parser.add_argument(
        "--caches",
        type=lambda s: s.split(","),
        default=["cold"],
        help="cold (a buffer larger than the last-level cache written before each call) and/or warm "
        "(the call run once right before the timed one)",
    )
    parser.add_argument(
        "--phases", type=lambda s: s.split(","), default=["decode", "prefill"], help="decode and/or prefill"
    )
    parser.add_argument(
        "--patterns", type=lambda s: s.split(","), default=list(_PATTERNS), help=",".join(_PATTERNS)
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layout",
        choices=("slots", "pages"),
        default="slots",
        help="slots: lora_pin against the peers' baselines; pages: the paged pool against the slot layout",
    )
    parser.add_argument("--page-rank", type=int, default=16, help="ranks per page (--layout pages)")
    parser.add_argument(
        "--path",
        choices=("ops", "layer"),
        default="ops",
        help="--layout pages: ops: the shrink and expand ops of each layout; layer: each layout as a model "
        "layer runs it on the CPU backend (checked and planned once per step)",
    )
    parser.add_argument(
        "--stat",
        choices=tuple(_STATS),
        default="median",
        help="--layout pages: each method's figure over the rounds; min leaves out what neighbours add on a "
        "shared machine; paired: min for the times, and the ratio is the median of per-round ratios of "
        "back-to-back calls (a second set of rounds)",
    )
    args = parser.parse_args(argv)
    for name in args.dtype:
        if name not in _DTYPES:
            parser.error(f"unknown dtype {name!r}; expected fp32, bf16 or fp16")
    for flag, values, known in (
        ("--caches", args.caches, ("cold", "warm")),
        ("--phases", args.phases, ("decode", "prefill")),
        ("--patterns", args.patterns, _PATTERNS),
    ):
        for value in values:
            if value not in known:
                parser.error(f"{flag}: unknown {value!r}; expected {', '.join(known)}")
    args.flush = torch.zeros(args.flush_mb * 2**20 // 4)
    print(
        f"torch {torch.__version__}, hidden {args.hidden}, ranks {args.ranks}, chunk {args.chunk_size}, "
        f"native kernels {'on' if grouped.use_cpu_kernels else 'off'}, "
        f"copy bandwidth {copy_bandwidth() / 1e9:.1f} GB/s, {args.rounds} rounds"
    )
    started = time.perf_counter()
    all_met = True
    for threads in args.threads:
        torch.set_num_threads(threads)
        if args.fixed_calls:
            print(f"\nfixed costs, {threads} thread{'s' if threads > 1 else ''} (µs per layer call, median):")
            costs = {**fixed_costs(args.fixed_calls), **embedding_fixed_costs(args.fixed_calls)}
            for name, micros in costs.items():
                print(f"  {name:46} {micros:8.2f}", flush=True)
        for cache in args.caches:
            args.cache = cache
            for dtype_name in args.dtype:
                gen = torch.Generator().manual_seed(args.seed)
                if args.layout == "pages":
                    pages_header(threads, dtype_name, args.cache, args.page_rank, args.stat)
                else:
                    table_header(threads, dtype_name, args.cache)
                for case in cases(args):
                    with torch.inference_mode():
                        if args.layout == "pages":
                            all_met &= print_pages_row(run_pages_case(case, _DTYPES[dtype_name], args, gen))
                        else:
                            all_met &= print_row(run_case(case, _DTYPES[dtype_name], args, gen), threads)
    if args.layout == "pages":
        what = (
            "the slot layout's shrink + expand ops; pages: paged_shrink + paged_expand"
            if args.path == "ops"
            else "the slot layout as a model layer runs it on the CPU; pages: the paged pool's"
        )
        print(
            f"\nslots: {what} on the\n"
            f"same adapters in pages of rank {args.page_rank}. goal: slots / pages >= {PAGES_GOAL}\n"
            "in every case.\n"
            "err: largest error against the fp64 reference, relative to the largest |output|."
        )
        print(f"goal met in every case: {all_met}; {time.perf_counter() - started:.1f} s")
        return 0
    print(
        "\npeft: PEFT's _mixed_batch_forward per module; gather-bmm: per-token weight gather then bmm;\n"
        "vllm: per-token gather per slice then batched products (vLLM's CPU SGMV); sglang: one einsum pair\n"
        "per request segment in request order (SGLang's torch backend). goal: lora_pin >= every baseline,\n"
        ">= 1.3x the best at 2 threads on mixed decode (distinct/uniform/zipf) over 64 adapters.\n"
        "err: lora_pin's largest error against the fp64 reference, relative to the largest |output|;\n"
        "err base: the smallest of the baselines' (the fp64 reference computed per slot from the slot map)."
    )
    print(f"goal met in every case: {all_met}; {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
