"""CPU benchmark: lora_pin's grouped shrink+expand against the two ways peers serve mixed-adapter batches.

Baselines, run in the same process on the same tensors:

- ``peft``: PEFT's mixed-batch forward (``adapter_names=[...]``): for each distinct adapter in the
  batch, find its rows (a torch mask, kinder than PEFT's Python list), gather them, ``x @ Aᵀ``,
  ``@ Bᵀ``, scale, and add back into those rows; per slice, at the adapter's real rank.
- ``gather-bmm``: gather every token's A and B from the stacked pool (padded to the max rank), then
  two batched matmuls (punica's and S-LoRA's "gather" baseline).

``lora_pin`` is timed on the planner's segment arrays (made once per step and shared by every layer,
so not timed here). Every case is checked against the others before it is timed.

    python benches/cpu_ops.py            # the default table, under a minute on 2 cores
    python benches/cpu_ops.py --help
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lora_pin._testing import PATTERNS, StackedLayer, random_layer, request_slots
from lora_pin.ops import lora_delta_, segments_from_slots

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    pattern: str
    phase: str  # "decode" (1 token per request) or "prefill"
    n_requests: int
    tokens_per_request: int
    n_slots: int


def peft_mixed_batch(
    out: torch.Tensor, x: torch.Tensor, adapter_names: list[int], layer: StackedLayer
) -> None:
    """Baseline (a): PEFT's ``LoraLayer._mixed_batch_forward``, step for step, less the base layer.

    PEFT runs it once per LoRA module (q, k and v are separate modules, here the slices): index lists
    built in Python per distinct adapter, gather, ``lora_A``, ``lora_B``, scale, add back.
    """
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


def peft_masked(out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, layer: StackedLayer) -> None:
    """Baseline (a'): PEFT's loop made kinder: rows by a torch mask, gathered once for all slices."""
    max_rank = layer.b.shape[2]
    ranks, scalings = layer.slot_ranks.tolist(), layer.slot_scalings.tolist()
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        sub = x[rows]
        for s, rank in enumerate(ranks[slot]):
            lo, hi = layer.slice_offsets[s], layer.slice_offsets[s + 1]
            a_s = layer.a[slot, s * max_rank : s * max_rank + rank]
            b_s = layer.b[slot, lo:hi, :rank]
            out[rows, lo:hi] += (sub @ a_s.T) @ b_s.T * scalings[slot][s]


def gather_bmm(out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, layer: StackedLayer) -> None:
    """Baseline (b): gather each token's weights (padded to the max rank), then batched matmuls."""
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


def time_interleaved(
    fns: Mapping[str, Callable[[], object]], budget_s: float, max_reps: int, flush: torch.Tensor
) -> dict[str, float]:
    """Best seconds of one call of each over interleaved rounds, caches flushed before every call.

    The methods take turns within every round, in an order that rotates from round to round, so a noisy
    neighbour slows them all alike; the best
    round (timeit's advice) is the one least disturbed. Writing ``flush`` (larger than the last-level
    cache) before each call makes every method start cold, as in a model where each layer's adapter
    weights come from memory once per step, and keeps one method from warming the cache for the next.
    """
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s * len(fns)
    rounds = 0
    names = list(fns)
    while rounds < max_reps and (rounds < 5 or time.perf_counter() < deadline):
        # The order rotates every round, so each method follows every other equally often: on this VM a
        # call made right after a long one runs measurably slower whatever it is.
        for i in range(len(names)):
            name = names[(rounds + i) % len(names)]
            fn = fns[name]
            flush.add_(1)
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
        rounds += 1
    return {name: min(times) for name, times in samples.items()}


def cases(decode_batch: int, prefill_requests: int, prefill_tokens: int) -> list[Case]:
    out = []
    for phase, n_requests, tokens in (
        ("decode", decode_batch, 1),
        ("prefill", prefill_requests, prefill_tokens),
    ):
        for pattern in PATTERNS:
            out.append(Case(pattern, phase, n_requests, tokens, n_slots=n_requests))
    return out


def run_case(case: Case, args: argparse.Namespace, gen: torch.Generator) -> dict[str, float | int | str]:
    dtype = _DTYPES[args.dtype]
    layer = random_layer(case.n_slots, args.hidden, args.slice_widths, args.ranks, dtype, gen)
    req_slots = request_slots(case.pattern, case.n_requests, case.n_slots, gen)
    token_slots = torch.repeat_interleave(req_slots, case.tokens_per_request)
    n_tokens = token_slots.shape[0]
    x = torch.randn(n_tokens, args.hidden, generator=gen).to(dtype)
    out0 = torch.randn(n_tokens, layer.slice_offsets[-1], generator=gen).to(dtype)
    meta = layer.meta(segments_from_slots(token_slots, args.chunk_size))
    adapter_names = token_slots.tolist()
    methods: dict[str, Callable[[torch.Tensor], object]] = {
        "peft": lambda o: peft_mixed_batch(o, x, adapter_names, layer),
        "peft-masked": lambda o: peft_masked(o, x, token_slots, layer),
        "gather-bmm": lambda o: gather_bmm(o, x, token_slots, layer),
        "lora_pin": lambda o: lora_delta_(o, x, layer.a, layer.b, meta),
    }
    results = {}
    for name, fn in methods.items():
        got = out0.clone()
        fn(got)
        results[name] = got.float()
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for name in ("peft", "peft-masked", "gather-bmm"):
        err = (results[name] - results["lora_pin"]).abs().max().item()
        if err > tol * max(1.0, results[name].abs().max().item()):
            raise AssertionError(f"{case}: lora_pin and {name} disagree by {err}")
    adapters = sorted(set(req_slots.tolist()) - {-1})
    covered = int((token_slots >= 0).sum())
    ranks = layer.slot_ranks.tolist()
    widths = [hi - lo for lo, hi in itertools.pairwise(layer.slice_offsets)]
    weight_elems = sum(r * (args.hidden + w) for k in adapters for r, w in zip(ranks[k], widths, strict=True))
    activation_elems = covered * (args.hidden + 2 * layer.slice_offsets[-1])  # x read, out read + written
    row: dict[str, float | int | str] = {
        "pattern": case.pattern,
        "phase": case.phase,
        "tokens": n_tokens,
        "adapters": len(adapters),
        "floor": (weight_elems + activation_elems) * x.element_size() / args.bandwidth,
    }
    scratch = {name: out0.clone() for name in methods}
    timed = {name: (lambda fn=fn, o=scratch[name]: fn(o)) for name, fn in methods.items()}
    row.update(time_interleaved(timed, args.budget, args.max_reps, args.flush))
    return row


def print_table(rows: list[dict[str, float | int | str]]) -> bool:
    """Prints the results; returns whether lora_pin met the goal in every case."""
    header = (
        f"{'phase':8} {'pattern':10} {'tokens':>6} {'adapters':>8} {'floor':>7} {'peft':>8} {'masked':>8} "
        f"{'gather':>8} {'lora_pin':>8}  {'peft/ours':>9} {'masked/ours':>11} {'gather/ours':>11} {'goal':>4}"
    )
    print(header)
    print("-" * len(header))
    all_met = True
    for r in rows:
        floor, ours = float(r["floor"]), float(r["lora_pin"])
        peft, masked, gather = float(r["peft"]), float(r["peft-masked"]), float(r["gather-bmm"])
        met = ours <= min(peft, gather) and (int(r["adapters"]) < 8 or peft / ours >= 2.0)
        all_met &= met
        print(
            f"{r['phase']:8} {r['pattern']:10} {r['tokens']:>6} {r['adapters']:>8} {floor * 1e3:>7.2f} "
            f"{peft * 1e3:>8.2f} {masked * 1e3:>8.2f} {gather * 1e3:>8.2f} {ours * 1e3:>8.2f}  "
            f"{peft / ours:>8.2f}x {masked / ours:>10.2f}x {gather / ours:>10.2f}x "
            f"{'ok' if met else 'MISS':>4}"
        )
    print(
        "times in ms, best of interleaved rounds. floor: the bytes every method must move (each\n"
        "distinct adapter's A and B at its real rank, x read, out read and written) over the measured\n"
        "copy bandwidth. peft: PEFT's _mixed_batch_forward per module; masked: the same loop with torch\n"
        "masks and one gather per adapter; gather: per-token weight gather then bmm.\n"
        "goal: lora_pin <= min(peft, gather), and >= 2x peft with >= 8 adapters."
    )
    return all_met


def copy_bandwidth() -> float:
    """Bytes per second of a 256 MiB device-to-device copy (read + write), best of 5."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=4096, help="input features of the layer")
    parser.add_argument(
        "--slice-widths",
        type=lambda s: [int(w) for w in s.split(",")],
        default=[4096, 1024, 1024],
        help="output width of each fused slice (default: q,k,v of a GQA 4096 model)",
    )
    parser.add_argument(
        "--ranks", type=lambda s: [int(r) for r in s.split(",")], default=[16], help="ranks cycled over slots"
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument(
        "--decode-batch", type=int, default=64, help="requests in a decode step (1 token each)"
    )
    parser.add_argument("--prefill-requests", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=128, help="tokens per prefill request")
    parser.add_argument("--chunk-size", type=int, default=16, help="segment chunk size, as the planner cuts")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds of timing per method and case")
    parser.add_argument("--max-reps", type=int, default=50)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default; 1 is steadiest on a shared box)",
    )
    parser.add_argument("--flush-mb", type=int, default=128, help="buffer written before each timed call")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    args.bandwidth = copy_bandwidth()
    args.flush = torch.zeros(args.flush_mb * 2**20 // 4)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, hidden {args.hidden}, "
        f"slices {args.slice_widths}, ranks {args.ranks}, chunk {args.chunk_size}, "
        f"copy bandwidth {args.bandwidth / 1e9:.1f} GB/s"
    )
    started = time.perf_counter()
    rows = []
    for case in cases(args.decode_batch, args.prefill_requests, args.prefill_tokens):
        with torch.inference_mode():
            rows.append(run_case(case, args, gen))
    all_met = print_table(rows)
    print(f"goal met in every case: {all_met}; {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
