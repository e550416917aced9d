"""The fixed cost of a fully sharded tensor-parallel layer call on the CPU, before and after its shrink
and expand were prepared once per step (issue 28).

One process, a gloo group of one, fully sharded layers of a tiny Llama cut as a framework cuts them (fused
q/k/v and gate_up column layers, o and down row layers; hidden 64, 4 tokens, rank 16, fp32): the cost
of the kernels is next to nothing, so what is left is the per-call overhead. For each layer kind:

- ``after``: the wrapped layer's call in an active step, less its base layer's call;
- ``before``: the same delta as the layer computed it before (the checked ``lora_pin::shrink`` and
  ``lora_pin::expand`` ops with the step's metadata on every call, the same collective), timed in the
  same process, alternating rounds with ``after``;
- ``no row uses the group``: a step whose adapter has no weights on the layer (after: skipped, no op and
  no collective; before: the same two ops and collective as any call).

Each is timed twice: with the collectives replaced by the copies a group of one computes (the layer's
own work alone: gloo's call costs hundreds of microseconds even in a group of one, and varies with the
load more than the rest), then with gloo's.

Then the row layers' expand into their column slice of the partial product (a strided view, TP = 2's
half of a 4096-wide output, rank 16): the native kernels on a contiguous copy of the slice, copied back,
against BLAS writing the strided slice in place, for a decode and a prefill step.

Run: ``.venv/bin/python benches/tp_layer_calls.py`` (``--threads``, ``--rounds``, ``--calls``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch
import torch.distributed as dist

from lora_pin import LoRAManager
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.ops import KernelMeta, expand, grouped, segments_from_slots, shrink
from lora_pin.ops.backends.cpu import CpuExpand
from lora_pin.parallel import ParallelLayout, TensorParallel, qkv_slices

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(root: Path, tp: TensorParallel) -> torch.nn.Module:
    """One decoder layer's linears, cut as a framework cuts them."""
    from safetensors.torch import load_file

    from lora_pin.parallel_fixtures import ColumnParallelLinear, RowParallelLinear

    weights = load_file(root / "model" / "model.safetensors")
    w = {k.rsplit(".", 2)[-2]: v for k, v in weights.items() if k.startswith("model.layers.0.")}
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    qkv = qkv_slices(tp, q_out=64, kv_out=16, num_kv_heads=1)
    fused = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])
    attn.qkv_proj = ColumnParallelLinear(fused, ParallelLayout("column", tp, 64, qkv))
    attn.o_proj = RowParallelLinear(w["o_proj"], tp)
    mlp.gate_up_proj = ColumnParallelLinear(
        torch.cat([w["gate_proj"], w["up_proj"]]), ParallelLayout.column(tp, 64, 128, 128)
    )
    mlp.down_proj = RowParallelLinear(w["down_proj"], tp)
    layer.self_attn, layer.mlp = attn, mlp
    model.model.layers = torch.nn.ModuleList([layer])
    return model


def _per_call(fn: Callable[[], object], calls: int) -> float:
    """Mean seconds per call over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _before(layer: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """The layer's delta as computed before the preparation (the fully sharded branch of
    ``ParallelLoRALinear._add_delta`` then): checked ops every call, the metadata cached per layer."""
    buf, shard, step_segments = layer._pool_buffers, layer._shard, layer._active_step()
    seg = step_segments.for_input(x)  # type: ignore[attr-defined]
    meta = KernelMeta.for_layer(seg, buf.ranks, buf.scalings, layer._offsets)
    tp = shard.tp
    if shard.layout.kind == "column":
        out = layer.base_layer(x)
        chunk = buf.a.shape[1] // meta.n_slices
        local = meta._replace(slot_ranks=(buf.ranks - tp.rank * chunk).clamp(0, chunk).to(torch.int32))

        def column() -> None:
            step_segments.for_input(x)  # type: ignore[attr-defined]
            v_local = shrink(x, buf.a, local)
            parts = [torch.empty_like(v_local) for _ in range(tp.size)]
            dist.all_gather(parts, v_local, group=tp.group)
            n = meta.n_slices
            v = (
                torch.stack(parts)
                .view(tp.size, -1, n, v_local.shape[1] // n)
                .permute(1, 2, 0, 3)
                .reshape(v_local.shape[0], -1)
            )
            expand(out, v, buf.b, meta)

        return column
    partial = layer.base_layer.partial(x)
    lo, hi = layer._columns

    def row() -> None:
        step_segments.for_input(x)  # type: ignore[attr-defined]
        v = shrink(x, buf.a, meta)
        dist.all_reduce(v, group=tp.group)
        expand(partial[:, lo:hi], v, buf.b, meta)

    return row


class _NoCollectives:
    """Replaces ``dist``'s all-gathers and ``all_reduce`` by what a group of one computes, without
    gloo: the layer's own work is then all that is timed (gloo's call costs hundreds of microseconds
    even in a group of one, and varies with the load more than the rest)."""

    def __enter__(self) -> None:
        self._saved = dist.all_gather, dist.all_gather_into_tensor, dist.all_reduce

        def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group: object = None) -> None:
            for part in parts:
                part.copy_(t)

        def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group: object = None) -> None:
            out.copy_(t)

        def all_reduce(t: torch.Tensor, group: object = None) -> None:
            return None

        dist.all_gather, dist.all_gather_into_tensor, dist.all_reduce = (  # type: ignore[assignment]
            all_gather,
            all_gather_into_tensor,
            all_reduce,
        )

    def __exit__(self, *exc: object) -> None:
        dist.all_gather, dist.all_gather_into_tensor, dist.all_reduce = self._saved  # type: ignore[assignment]


def _parts(module: torch.nn.Module, x: torch.Tensor, rounds: int, calls: int) -> dict[str, list[float]]:
    """The parts of a fully sharded layer call with adapter rows, each timed alone: the lookup of the
    step's prepared pair, the shrink (checks, op, kernels), the column layer's all-gather and reshuffle
    (with the collective replaced), the expand."""
    step = module._active_step()
    kernels = module._backend.kernels(step)
    split = kernels.split_delta(module._pool_buffers, x, module._offsets, module._shrink_ranks)
    shrink_d, expand_d = split.shrink_work, split.expand_work
    v = shrink_d.apply(x)
    out = module.base_layer(x) if module._column else module.base_layer.partial(x)
    lo, hi = module._columns
    gathered = module._all_gather(v, expand_d.meta.n_slices) if module._column else v
    parts: dict[str, Callable[[], object]] = {
        "lookup of the prepared pair": lambda: kernels.split_delta(
            module._pool_buffers, x, module._offsets, module._shrink_ranks
        ),
        "shrink (checks + op + kernels)": lambda: shrink_d.apply(x),
        "expand (checks + op + kernels)": lambda: expand_d.apply(out[:, lo:hi], gathered),
    }
    if module._column:
        parts["all-gather reshuffle (copy for the collective)"] = lambda: module._all_gather(
            v, expand_d.meta.n_slices
        )
    found: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in parts.items():
            found.setdefault(name, []).append(_per_call(fn, calls))
    return found


def layer_costs(root: Path, rounds: int, calls: int, collectives: bool) -> dict[str, float]:
    """Microseconds per call, median over alternating rounds (see the module); with ``collectives``
    False, the collectives replaced by :class:`_NoCollectives`."""
    tp = TensorParallel(0, 1, fully_sharded=True)
    model = _model(root, tp)
    mgr = LoRAManager(
        model,
        [f"{n}={root / n}" for n in ("a", "c")],
        max_loras_per_batch=2,
        max_lora_rank=16,
        fused_modules={
            "qkv_proj": [("q_proj", 64), ("k_proj", 16), ("v_proj", 16)],
            "gate_up_proj": [("gate_proj", 128), ("up_proj", 128)],
        },
        tp=tp,
    )
    layer = model.model.layers[0]
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "column (fused q/k/v)": (layer.self_attn.qkv_proj, torch.randn(4, 64, generator=gen)),
        "row (down)": (layer.mlp.down_proj, torch.randn(4, 128, generator=gen)),
    }
    samples: dict[str, list[float]] = {}
    # "a" targets every module; "c" only o, gate and up, so no row of its step uses q/k/v or down.
    for used, names in (
        ("adapter rows", ["a", None, "a", "c"]),
        ("no row uses the group", ["c", None, "c", None]),
    ):
        step = mgr.prepare_step(names, 1)
        try:
            with torch.inference_mode():
                for kind, (module, x) in inputs.items():
                    before = _before(module, x)

                    def base(module: torch.nn.Module = module, x: torch.Tensor = x) -> object:
                        return module.base_layer(x)

                    def after(module: torch.nn.Module = module, x: torch.Tensor = x) -> object:
                        return module(x)

                    with contextlib.nullcontext() if collectives else _NoCollectives():
                        for fn in (before, base, after):
                            fn()
                        for _ in range(rounds):
                            for label, fn in (("before", before), ("base", base), ("after", after)):
                                samples.setdefault(f"{kind}, {used}: {label}", []).append(
                                    _per_call(fn, calls)
                                )
                        if used == "adapter rows" and not collectives:
                            for part, values in _parts(module, x, rounds, calls).items():
                                samples[f"  {kind}, {part}"] = values
        finally:
            mgr.finish(step)
    mgr.detach()
    if collectives:
        v = torch.zeros(4, 48)
        samples["gloo all_reduce [4, 48] alone (world 1)"] = [
            _per_call(lambda: dist.all_reduce(v), calls) for _ in range(rounds)
        ]
    figures = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    for name in list(figures):
        if name.endswith(": after"):
            figures[name] -= figures[name.replace(": after", ": base")]
    return {name: value for name, value in figures.items() if not name.endswith(": base")}


def row_expand_costs(rounds: int, calls: int) -> dict[str, float]:
    """Microseconds of a row layer's expand into its column slice: native kernels on a copy vs BLAS."""
    from lora_pin._testing import random_layer

    gen = torch.Generator().manual_seed(1)
    figures: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        layer = random_layer(8, 16, [2048], [16], dtype, gen)
        for label, token_slots in (
            ("decode 64 tokens, 8 adapters", torch.arange(64) % 8),
            ("prefill 8 x 128, 8 adapters", torch.arange(8).repeat_interleave(128)),
        ):
            tokens = token_slots.shape[0]
            meta = layer.meta(segments_from_slots(token_slots))
            native = CpuExpand.prepare(meta, layer.b, tokens)
            blas = CpuExpand(meta, layer.b, tokens, grouped.plan_for(meta, tokens, 16, dtype, kernel=False))
            v = torch.randn(tokens, 16, generator=gen).to(dtype)
            partial = torch.randn(tokens, 4096, generator=gen).to(dtype)
            columns = partial[:, 2048:]
            times: dict[str, list[float]] = {"native on a copy": [], "BLAS in place": []}
            n = max(calls // (tokens // 4), 5)
            with torch.inference_mode():
                for _ in range(rounds):
                    times["native on a copy"].append(
                        _per_call(lambda e=native, c=columns, w=v: e.apply(c, w), n)
                    )
                    times["BLAS in place"].append(_per_call(lambda e=blas, c=columns, w=v: e.apply(c, w), n))
            has_kernel = native.plan.kernel is not None or native.plan.runs_expand is not None
            for what, values in times.items():
                name = f"{str(dtype).removeprefix('torch.')} {label}: {what}"
                figures[name] = (
                    statistics.median(values) * 1e6 if has_kernel or what == "BLAS in place" else float("nan")
                )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=400, help="calls per round of each timing")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            make_tiny_llama(root / "model", heads=4, kv_heads=1, layers=1)
            make_peft_adapter(root / "model", root / "a", r=16, lora_alpha=32, target_modules=ALL, seed=1)
            make_peft_adapter(
                root / "model",
                root / "c",
                r=16,
                lora_alpha=32,
                target_modules=["o_proj", "gate_proj", "up_proj"],
            )
            for collectives in (False, True):
                costs = layer_costs(root, args.rounds, args.calls, collectives)
                what = (
                    "with gloo's collectives (world 1)" if collectives else "collectives replaced by copies"
                )
                print(
                    f"fully sharded layer calls, {what}, µs per call (median of {args.rounds} alternating "
                    f"rounds, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}):"
                )
                for name, value in costs.items():
                    print(f"  {name:<58} {value:8.2f}")
                for kind in ("column (fused q/k/v)", "row (down)"):
                    for used in ("adapter rows", "no row uses the group"):
                        before, after = costs[f"{kind}, {used}: before"], costs[f"{kind}, {used}: after"]
                        print(f"  {kind}, {used}: before / after = {before / max(after, 1e-3):.1f}x")
        print("\nrow layer's expand into its column slice (2048 of 4096 columns, rank 16), µs per call:")
        for name, value in row_expand_costs(args.rounds, args.calls).items():
            print(f"  {name:<58} {value:10.1f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
