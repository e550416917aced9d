"""GPU benchmark of the lora_pin ops: correctness, then shrink+expand timings against the grouped torch path.

On a CUDA machine it:

1. checks the Triton ops (fp16 and bf16, mixed ranks, fused q/k/v slices, base-model rows) against the
   float64 reference, and that a step is captured by a CUDA graph without a host-device sync;
2. measures the device-to-device copy bandwidth;
3. times shrink+expand (CUDA events, caches flushed before each call; eager and replayed from a CUDA
   graph) for decode batches of 1..256 tokens and a prefill batch, 1..64 distinct adapters, ranks
   8/16/64, hidden sizes 4096 and 8192, against the grouped torch path on the same GPU;
4. prints achieved GB/s against the copy bandwidth and checks the goals: at least 50% of copy
   bandwidth once weight traffic is 16 MB or more, and at least 3x the grouped path at 64 adapters.

Everything fits in 10 minutes on one H200 (``--budget-s`` stops early, listing what it skipped).

    python benches/gpu_ops.py                 # everything
    python benches/gpu_ops.py --dry-run       # no GPU needed: the case list, every kernel the run
                                              # launches built for sm_90 (registers, spills, shared
                                              # memory), and one tiny case through the Triton
                                              # interpreter on CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from lora_pin._testing import PATTERNS, StackedLayer, random_layer, request_slots
from lora_pin.ops import CUDA_CHUNK_SIZE, KernelMeta, lora_delta_, lora_reference, segments_from_slots
from lora_pin.ops.grouped import expand_grouped, shrink_grouped
from lora_pin.ops.triton_sgmv import expand_launch, shrink_launch, shrink_split_k

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


@dataclass(frozen=True)
class Case:
    hidden: int
    rank: int
    phase: str  # "decode" or "prefill"
    tokens: int
    adapters: int  # distinct adapters in the batch

    def weight_bytes(self, element_size: int) -> int:
        """A and B of every distinct adapter: what a step must read at least once."""
        return self.adapters * self.rank * 2 * self.hidden * element_size

    def activation_bytes(self, element_size: int) -> int:
        """x read, v written and read back, out read and written."""
        return self.tokens * (3 * self.hidden + 2 * self.rank) * element_size


def build_cases(
    hiddens: list[int], ranks: list[int], decode_batches: list[int], adapters: list[int], prefill: int
):
    cases = []
    for hidden, rank in itertools.product(hiddens, ranks):
        for tokens in decode_batches:
            for n in adapters:
                if n <= tokens:
                    cases.append(Case(hidden, rank, "decode", tokens, n))
        for n in adapters:
            cases.append(Case(hidden, rank, "prefill", prefill, n))
    return cases


def make_inputs(case: Case, dtype: torch.dtype, device: str, gen: torch.Generator):
    """A plain (one-slice) hidden -> hidden layer; tokens spread evenly over case.adapters slots, in
    segments of at most CUDA_CHUNK_SIZE tokens (what LoRAManager plans on CUDA)."""
    layer = random_layer(
        max(case.adapters, 1), case.hidden, [case.hidden], [case.rank], dtype, gen, device=device
    )
    if case.phase == "decode":
        token_slots = request_slots("distinct", case.tokens, case.adapters, gen)
    else:
        per_request = case.tokens // case.adapters
        token_slots = torch.repeat_interleave(
            torch.arange(case.adapters), torch.full((case.adapters,), per_request)
        )
        token_slots = torch.cat(
            [token_slots, torch.zeros(case.tokens - token_slots.numel(), dtype=torch.int64)]
        )
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(device=device, dtype=dtype)
    out = torch.randn(case.tokens, case.hidden, generator=gen).to(device=device, dtype=dtype)
    token_slots = token_slots.to(device)
    return layer, token_slots, segments_from_slots(token_slots, CUDA_CHUNK_SIZE), x, out


def grouped_path(out: torch.Tensor, x: torch.Tensor, layer: StackedLayer, batch: KernelMeta) -> None:
    """The grouped torch path (what CPU tensors run), here on the GPU: the baseline."""
    meta = layer.meta(batch)
    expand_grouped(out, shrink_grouped(x, layer.a, meta), layer.b, meta)


def check_correctness(device: str, gen: torch.Generator, log: Callable[[str], None]) -> bool:
    """Triton ops against the float64 reference over every pattern, fp16 and bf16, fused GQA slices."""
    ok = True
    ranks: list[int | tuple[int, ...]] = [8, 16, 64, (16, 0, 8), 1]
    for dtype, pattern in itertools.product(_DTYPES.values(), PATTERNS):
        layer = random_layer(8, 512, [512, 128, 128], ranks, dtype, gen, device=device)
        slots = request_slots(pattern, 24, 8, gen, base_fraction=0.2)
        token_slots = torch.repeat_interleave(slots, torch.randint(1, 6, (24,), generator=gen)).to(device)
        x = torch.randn(token_slots.shape[0], 512, generator=gen).to(device=device, dtype=dtype)
        out = torch.randn(token_slots.shape[0], 768, generator=gen).to(device=device, dtype=dtype)
        got = out.clone()
        with torch.inference_mode():
            lora_delta_(got, x, layer.a, layer.b, layer.meta(segments_from_slots(token_slots, 16)))
        want = lora_reference(out, x, layer.a, layer.b, token_slots, *layer[2:])
        err = (got.double() - want.double()).abs().max().item()
        tol = _TOLERANCE[dtype] * max(1.0, want.double().abs().max().item())
        base = token_slots < 0
        untouched = torch.equal(got[base], out[base])
        case_ok = err <= tol and untouched
        ok &= case_ok
        log(f"  {dtype!s:15} {pattern:10} max err {err:.2e} (tol {tol:.1e}) base rows untouched: {untouched}")
    return ok


def check_graph_capture(device: str, gen: torch.Generator, log: Callable[[str], None]) -> bool:
    """A step captured in a CUDA graph with sync debug mode 'error', replayed, equals eager."""
    layer = random_layer(16, 1024, [1024, 256, 256], [16], torch.float16, gen, device=device)
    token_slots = request_slots("zipf", 64, 16, gen).to(device)
    batch = segments_from_slots(token_slots, 16)
    x = torch.randn(64, 1024, generator=gen).to(device=device, dtype=torch.float16)
    out = torch.randn(64, 1536, generator=gen).to(device=device, dtype=torch.float16)
    eager, work = out.clone(), out.clone()
    with torch.inference_mode():
        lora_delta_(eager, x, layer.a, layer.b, layer.meta(batch))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                lora_delta_(work, x, layer.a, layer.b, layer.meta(batch))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        work.copy_(out)
        graph.replay()
        torch.cuda.synchronize()
    err = (work.float() - eager.float()).abs().max().item()
    log(f"  CUDA graph capture without sync, replay vs eager: max diff {err:.2e}")
    return err <= 1e-2


def copy_bandwidth(device: str) -> float:
    """Bytes per second (read + write) of a 1 GiB device-to-device copy, best of 10."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / best


def time_calls(fn: Callable[[], object], flush: torch.Tensor, reps: int) -> float:
    """Median seconds of one call on the GPU timeline (CUDA events), L2 flushed before each."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run_case(case: Case, args: argparse.Namespace, gen: torch.Generator, flush: torch.Tensor) -> dict:
    dtype = _DTYPES[args.dtype]
    layer, _, batch, x, out = make_inputs(case, dtype, "cuda", gen)
    work = out.clone()

    def triton_step():
        lora_delta_(work, x, layer.a, layer.b, layer.meta(batch))

    with torch.inference_mode():
        eager = time_calls(triton_step, flush, args.reps)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_step()
        graphed = time_calls(graph.replay, flush, args.reps)
        grouped = time_calls(lambda: grouped_path(work, x, layer, batch), flush, max(3, args.reps // 4))
    element = x.element_size()
    moved = case.weight_bytes(element) + case.activation_bytes(element)
    best = min(eager, graphed)
    return {
        **asdict(case),
        "weight_mb": case.weight_bytes(element) / 1e6,
        "eager_us": eager * 1e6,
        "graph_us": graphed * 1e6,
        "grouped_us": grouped * 1e6,
        "gb_s": moved / best / 1e9,
        "copy_fraction": moved / best / args.bandwidth,
        "speedup": grouped / best,
    }


def print_rows(rows: list[dict]) -> tuple[bool, bool]:
    header = (
        f"{'hidden':>6} {'rank':>4} {'phase':8} {'tokens':>6} {'adapters':>8} {'weights MB':>10} "
        f"{'eager us':>9} {'graph us':>9} {'grouped us':>10} {'GB/s':>7} {'%copy':>6} {'vs grouped':>10}"
    )
    print(header)
    print("-" * len(header))
    bandwidth_ok = speedup_ok = True
    for r in rows:
        marks = ""
        if r["weight_mb"] >= 16:
            hit = r["copy_fraction"] >= 0.5
            bandwidth_ok &= hit
            marks += " bw" + ("+" if hit else "-")
        if r["adapters"] >= 64:
            hit = r["speedup"] >= 3
            speedup_ok &= hit
            marks += " x3" + ("+" if hit else "-")
        print(
            f"{r['hidden']:>6} {r['rank']:>4} {r['phase']:8} {r['tokens']:>6} {r['adapters']:>8} "
            f"{r['weight_mb']:>10.1f} {r['eager_us']:>9.1f} {r['graph_us']:>9.1f} {r['grouped_us']:>10.1f} "
            f"{r['gb_s']:>7.0f} {100 * r['copy_fraction']:>5.0f}% {r['speedup']:>9.1f}x{marks}"
        )
    return bandwidth_ok, speedup_ok


def case_launches(layer: StackedLayer, batch: KernelMeta, x: torch.Tensor, out: torch.Tensor, sm_count: int):
    """The shrink and expand launches the CUDA ops would make for these inputs on a GPU with
    ``sm_count`` multiprocessors (built from shapes and strides; the tensors may be on the CPU)."""
    n_slices = len(layer.slice_offsets) - 1
    max_rank = layer.a.shape[1] // n_slices
    split = shrink_split_k(x.shape[1], batch.seg_slots.shape[0], n_slices, max_rank, x.dtype, 2 * sm_count)
    v = x.new_zeros(x.shape[0], n_slices * max_rank, dtype=torch.float32 if split > 1 else x.dtype)
    meta = layer.meta(batch)
    shrink = shrink_launch(x, layer.a, v, meta, max_rank, split, interpret=False)
    v = x.new_zeros(x.shape[0], n_slices * max_rank)
    expand = expand_launch(out, v, layer.b, meta, max_rank, interpret=False)
    return shrink, expand


def build_all(cases: list[Case], args: argparse.Namespace) -> bool:
    """Compile, for sm_{args.arch}, every kernel specialization this script would launch; print the
    resource use of each distinct one. No GPU needed. True when all compile with no spills and fit."""
    from lora_pin.ops.triton_aot import compile_launch

    gen = torch.Generator().manual_seed(args.seed)
    dtype = _DTYPES[args.dtype]
    inputs = []
    for dt in _DTYPES.values():  # the correctness and graph-capture shapes
        layer = random_layer(8, 512, [512, 128, 128], [8, 16, 64, (16, 0, 8), 1], dt, gen)
        token_slots = request_slots("zipf", 64, 8, gen)
        x = torch.randn(64, 512, generator=gen).to(dt)
        inputs.append((layer, segments_from_slots(token_slots, 16), x, torch.zeros(64, 768, dtype=dt)))
    seen: dict[str, object] = {}
    ok = True
    builds = [launch for inp in inputs for launch in case_launches(*inp, args.sm_count)]
    for case in cases:
        layer, _, batch, x, out = make_inputs(case, dtype, "cpu", gen)
        builds.extend(case_launches(layer, batch, x, out, args.sm_count))
    print(f"sm_{args.arch} builds of {len(builds)} launches ({args.sm_count} SMs assumed):")
    for launch in builds:
        build = compile_launch(launch, args.arch)
        if build.key in seen:
            continue
        seen[build.key] = build
        ok &= build.fits
        consts = " ".join(f"{k}={v}" for k, v in build.constexprs.items() if k != "DOT_PRECISION")
        dtype = str(launch.args[0].dtype).removeprefix("torch.")
        print(
            f"  {build.name:20} {dtype:8} {consts:70} warps {build.num_warps} regs {build.registers:3} "
            f"spill {build.local_bytes:3} B smem {build.shared_bytes / 1024:6.1f} KiB"
            + ("" if build.fits else "  <- does not fit")
        )
    print(f"{len(seen)} distinct kernels; all compile, no spills, shared memory fits: {ok}")
    return ok


def dry_run(cases: list[Case], args: argparse.Namespace) -> int:
    """Without a GPU: the case list, every kernel built for sm_90, then one tiny case through the
    Triton interpreter on CPU."""
    from lora_pin.ops.triton_sgmv import sgmv_expand, sgmv_shrink

    element = torch.finfo(_DTYPES[args.dtype]).bits // 8
    print(f"{len(cases)} cases; weight traffic per case {args.dtype}:")
    for case in cases:
        print(f"  {case}  weights {case.weight_bytes(element) / 1e6:.1f} MB")
    built = build_all(cases, args)
    gen = torch.Generator().manual_seed(args.seed)
    tiny = Case(hidden=64, rank=16, phase="decode", tokens=8, adapters=4)
    layer, token_slots, batch, x, out = make_inputs(tiny, torch.float16, "cpu", gen)
    meta = layer.meta(batch)
    v = sgmv_shrink(x, layer.a, meta, interpret=True)
    got = out.clone()
    sgmv_expand(got, v, layer.b, meta, interpret=True)
    want = lora_reference(out, x, layer.a, layer.b, token_slots, *layer[2:])
    err = (got.double() - want.double()).abs().max().item()
    print(f"tiny case under the Triton interpreter: max err {err:.1e}")
    return 0 if built and err <= _TOLERANCE[torch.float16] else 1


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=_ints, default=[4096, 8192])
    parser.add_argument("--ranks", type=_ints, default=[8, 16, 64])
    parser.add_argument("--decode-batches", type=_ints, default=[1, 16, 64, 256])
    parser.add_argument("--adapters", type=_ints, default=[1, 8, 64], help="distinct adapters per batch")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="dtype of the timed cases")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per case and method")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting new cases after this")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: list the cases, build every kernel for --arch, run one tiny case on CPU",
    )
    parser.add_argument("--arch", type=int, default=90, help="--dry-run: compute capability to build for")
    parser.add_argument("--sm-count", type=int, default=132, help="--dry-run: multiprocessors (H200: 132)")
    args = parser.parse_args(argv)
    cases = build_cases(args.hidden, args.ranks, args.decode_batches, args.adapters, args.prefill_tokens)
    if args.dry_run:
        return dry_run(cases, args)
    if not torch.cuda.is_available():
        print("no CUDA device; use --dry-run on a machine without a GPU", file=sys.stderr)
        return 2

    started = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("correctness against the float64 reference:")
    correct = check_correctness("cuda", gen, print)
    graph_ok = check_graph_capture("cuda", gen, print)
    args.bandwidth = copy_bandwidth("cuda")
    print(f"device-to-device copy bandwidth: {args.bandwidth / 1e9:.0f} GB/s (read + write)")
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # larger than any L2

    rows, skipped = [], []
    for case in cases:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(case)
            continue
        rows.append(run_case(case, args, gen, flush))
        # Each row as it comes, and the JSON so far: a run stopped from outside keeps what it measured.
        print(f"  measured {json.dumps(rows[-1])}", flush=True)
        _write_json(args, rows, skipped)
    bandwidth_ok, speedup_ok = print_rows(rows)
    print(
        "eager/graph: Triton ops per call, eager and replayed from a CUDA graph; grouped: the grouped\n"
        "torch path on the same GPU. GB/s: (weights + activations) / best of eager and graph. Marks:\n"
        "bw = at least 50% of copy bandwidth (weights >= 16 MB), x3 = at least 3x the grouped path\n"
        "(64 adapters)."
    )
    for case in skipped:
        print(f"skipped (over --budget-s): {case}")
    print(
        f"correct: {correct}; graph capture: {graph_ok}; >= 50% copy bandwidth at >= 16 MB: {bandwidth_ok}; "
        f">= 3x grouped at 64 adapters: {speedup_ok}; {time.perf_counter() - started:.0f} s"
    )
    _write_json(args, rows, skipped)
    return 0 if correct and graph_ok else 1


def _write_json(args: argparse.Namespace, rows: list[dict], skipped: list[Case]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": args.bandwidth, "rows": rows, "skipped": [asdict(c) for c in skipped]}, f)


if __name__ == "__main__":
    sys.exit(main())
