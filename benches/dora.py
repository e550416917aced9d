"""What serving a DoRA adapter costs against a plain LoRA adapter of the same rank, on the CPU.

Three comparisons, each against its named baseline in the same process, reported as ratios:

1. *op*: one layer's adapter work for a decode batch, LoRA (the prepared shrink + expand,
   ``CpuDelta.apply``) against DoRA (the same, then the rescale of the DoRA rows the layers run on
   the CPU, ``scale_rows_``: one native call for float32), per adapter row; the same with the rescale in
   torch (``scale_rows_torch_``: gathers, arithmetic, scatter) as a second row;
2. *step*: a whole decode forward of a small Llama under ``LoRAManager.batch`` with every row on DoRA
   adapters against the same rows on their plain twins (same A and B, no magnitudes); the adapters'
   share (step minus the base-only step) is reported too, and a LoRA-only step with DoRA adapters resident
   in other slots against one with none (what DoRA costs the steps that do not use it);
3. *load*: ``HostTier.read`` of a DoRA adapter (which computes its factors against the base weights)
   against its plain twin, and against the same read with the norms expanded as before (``expanded_parts``
   patched in for ``dora_norm_parts``);
4. *norm*: one layer's ``||W + s B A||`` per output feature as the reads compute it
   (``dora_norm_parts``: rows of ``W + s B A`` formed in float64, block by block) against the square
   expanded in float32 (``||W||^2 + 2 s <W, B A> + s^2 ||B A||^2``, what ran before, kept here as the
   baseline), for float32 and bfloat16 base weights.

Goal: DoRA rows at most 1.2x the LoRA cost per row. The op and step figures are medians of rounds that
alternate between the cases compared (a busy neighbour then slows each alike).

Run: ``.venv/bin/python benches/dora.py`` (``--hidden``, ``--rank``, ``--rows``, ``--adapters``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def alternating_us(fns: dict[str, Callable[[], object]], calls: int, rounds: int = 9) -> dict[str, float]:
    """Median over ``rounds`` of each function's mean microseconds per call, the functions taking turns
    round by round (a noisy neighbour then slows all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def op_case(args: argparse.Namespace, hidden: int) -> dict[str, float]:
    """One layer (``hidden`` -> ``hidden``, bias) for ``rows`` decode rows over ``adapters`` slots, every
    slot DoRA, the rows prepared as the layers prepare them on the CPU (once per step)."""
    import torch

    from lora_pin._testing import random_layer
    from lora_pin.ops import segments_from_slots
    from lora_pin.ops.backends.cpu import CpuDelta
    from lora_pin.ops.dora import scale_rows_, scale_rows_torch_

    gen = torch.Generator().manual_seed(0)
    layer = random_layer(args.adapters, hidden, [hidden], [args.rank], torch.float32, gen)
    token_slots = torch.arange(args.rows) % args.adapters
    seg = segments_from_slots(token_slots)
    meta = layer.meta(seg)
    x = torch.randn(args.rows, hidden, generator=gen)
    out = torch.randn(args.rows, hidden, generator=gen)
    bias = torch.randn(hidden, generator=gen)
    delta = CpuDelta.prepare(meta, layer.a, layer.b, args.rows)
    factors = 1 + 0.1 * torch.randn(args.adapters, hidden, generator=gen)
    counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
    long_slots = torch.repeat_interleave(seg.seg_slots, counts).long()

    fresh = out.clone()

    # Each call starts from the base output (repeated rescales would overflow it into inf, whose
    # arithmetic is far slower); the copy is in both.
    def lora() -> None:
        out.copy_(fresh)
        delta.apply(out, x)

    def with_dora() -> None:
        out.copy_(fresh)
        delta.apply(out, x)
        scale_rows_(out, bias, factors, seg.perm, long_slots)

    def with_dora_torch() -> None:
        out.copy_(fresh)
        delta.apply(out, x)
        scale_rows_torch_(out, bias, factors, seg.perm, long_slots)

    with torch.inference_mode():
        us = alternating_us({"lora": lora, "dora": with_dora, "dora_torch": with_dora_torch}, args.calls)
    return {
        "hidden": hidden,
        "lora_us": us["lora"],
        "dora_us": us["dora"],
        "ratio": us["dora"] / us["lora"],
        "dora_torch_rescale_us": us["dora_torch"],
        "torch_rescale_ratio": us["dora_torch"] / us["lora"],
    }


def expanded_norm_sq(weight: Any, a: Any, b: Any, scaling: float) -> Any:
    """``||W_i + s B_i A||^2`` per row with the square expanded, in float32, 1024 rows at a time (the
    baseline of :func:`norm_case`; it loses rows that are small against ``W``)."""
    import torch

    norm_sq = torch.zeros(weight.shape[0], dtype=torch.float32)
    a = a.float()
    gram = a @ a.T
    for row in range(0, weight.shape[0], 1024):
        w = weight[row : row + 1024].float()
        b_rows = b[row : row + 1024].float()
        cross = (b_rows * (w @ a.T)).sum(dim=1)
        own = ((b_rows @ gram) * b_rows).sum(dim=1)
        norm_sq[row : row + 1024] = torch.linalg.vector_norm(w, dim=1).square() + 2 * scaling * cross
        norm_sq[row : row + 1024] += scaling * scaling * own
    return norm_sq


def expanded_parts(weight: Any, a: Any, b: Any, slices: Any) -> Any:
    """``dora_norm_parts``'s result with the squared norms of :func:`expanded_norm_sq` and no rounding
    bound: patched into a read for the *load* case's baseline (the read as it ran before)."""
    import torch

    parts = torch.zeros(2, weight.shape[0], dtype=torch.float64)
    max_rank = a.shape[0] // max(len(slices), 1)
    for s, spec in enumerate(slices):
        if spec is not None:
            first, last, rank, scaling = spec
            a_s = a[s * max_rank : s * max_rank + rank]
            parts[0, first:last] = expanded_norm_sq(weight[first:last], a_s, b[first:last, :rank], scaling)
    return parts


def norm_case(args: argparse.Namespace, out: int, width: int, dtype_name: str) -> dict[str, Any]:
    """One ``[out, width]`` layer's DoRA norms at rank ``args.rank``: blocks in float64 against the
    expanded square in float32."""
    import torch

    from lora_pin.weights.dora import dora_norm_parts

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(out, width, generator=gen).to(dtype)
    a = 0.1 * torch.randn(args.rank, width, generator=gen).to(dtype)
    b = 0.1 * torch.randn(out, args.rank, generator=gen).to(dtype)
    slices = [(0, out, args.rank, 2.0)]
    with torch.inference_mode():
        us = alternating_us(
            {
                "expanded": lambda: expanded_norm_sq(weight, a, b, 2.0),
                "blocks": lambda: dora_norm_parts(weight, a, b, slices),
            },
            max(args.calls // 100, 3),
        )
    return {
        "shape": [out, width],
        "dtype": dtype_name,
        "expanded_us": us["expanded"],
        "blocks_us": us["blocks"],
        "ratio": us["blocks"] / us["expanded"],
    }


def model_cases(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The decode step and the load, over a small Llama with DoRA adapters and their plain twins."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from lora_pin import LoRAManager
    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
    from lora_pin.weights import building

    transformers.logging.set_verbosity_error()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_dir = make_tiny_llama(
            root / "base", hidden=args.hidden, intermediate=2 * args.hidden, layers=2, heads=8, kv_heads=4
        )
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
        dora, twins = [], []
        for i in range(args.adapters):
            path = make_peft_adapter(
                base,
                root / f"d{i}",
                r=args.rank,
                lora_alpha=16,
                target_modules=targets,
                seed=i,
                use_dora=True,
            )
            twin = root / f"t{i}"
            twin.mkdir()
            tensors = load_file(str(path / "adapter_model.safetensors"))
            save_file(
                {k: v for k, v in tensors.items() if "magnitude" not in k},
                str(twin / "adapter_model.safetensors"),
            )
            config = json.loads((path / "adapter_config.json").read_text())
            (twin / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
            dora.append(path)
            twins.append(twin)
        model = copy.deepcopy(base)
        items = [f"d{i}={p}" for i, p in enumerate(dora)] + [f"t{i}={p}" for i, p in enumerate(twins)]
        mgr = LoRAManager(model, items, max_loras_per_batch=2 * args.adapters, max_lora_rank=args.rank)
        ids = torch.randint(0, 128, (args.rows, 1), generator=torch.Generator().manual_seed(1))

        def step(names: list[str | None]) -> Callable[[], object]:
            def run() -> object:
                with mgr.batch(names):
                    return model(input_ids=ids)

            return run

        on_dora = [f"d{i % args.adapters}" for i in range(args.rows)]
        on_twin = [f"t{i % args.adapters}" for i in range(args.rows)]
        calls = max(args.calls // 50, 5)
        # A LoRA-only step beside resident DoRA adapters, against a manager that holds no DoRA adapter.
        alone = copy.deepcopy(base)
        plain_only = LoRAManager(
            alone, [f"t{i}={p}" for i, p in enumerate(twins)], max_loras_per_batch=args.adapters
        )

        def plain_step() -> object:
            with plain_only.batch(on_twin):
                return alone(input_ids=ids)

        with torch.inference_mode():
            for names in (on_dora, on_twin):
                step(names)()  # every adapter in its slot before timing
            plain_step()
            steps = alternating_us(
                {
                    "base": step([None] * args.rows),
                    "twin": step(on_twin),
                    "dora": step(on_dora),
                    "plain": plain_step,
                },
                calls,
            )
            base_us, twin_us, dora_us, plain_us = (steps[k] for k in ("base", "twin", "dora", "plain"))

        def read_expanded() -> object:
            with mock.patch.object(building, "dora_norm_parts", expanded_parts):
                return mgr.host.read("x", dora[0])

        reads = alternating_us(
            {
                "dora": lambda: mgr.host.read("x", dora[0]),
                "expanded": read_expanded,
                "twin": lambda: mgr.host.read("x", twins[0]),
            },
            max(calls // 2, 3),
        )
        read_dora, read_twin = reads["dora"], reads["twin"]
    return {
        "step": {
            "base_us": base_us,
            "lora_us": twin_us,
            "dora_us": dora_us,
            "ratio": dora_us / twin_us,
            "adapter_share_ratio": (dora_us - base_us) / (twin_us - base_us),
        },
        "lora_step_beside_dora": {"without_us": plain_us, "with_us": twin_us, "ratio": twin_us / plain_us},
        "load": {"lora_us": read_twin, "dora_us": read_dora, "ratio": read_dora / read_twin},
        "load_vs_expanded_norm": {
            "expanded_us": reads["expanded"],
            "blocks_us": read_dora,
            "ratio": read_dora / reads["expanded"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--wide", type=int, default=4096, help="the op case again at this width")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args(argv)
    results = {
        "op": op_case(args, args.hidden),
        "op_wide": op_case(args, args.wide),
        **model_cases(args),
        **{
            f"norm_{out}x{width}_{dtype}": norm_case(args, out, width, dtype)
            for out, width in ((args.hidden, args.hidden), (args.wide, args.wide))
            for dtype in ("float32", "bfloat16")
        },
    }
    print(json.dumps({"args": vars(args), **results}, indent=2))
    for name, r in results.items():
        print(f"{name:>22}: ratio {r['ratio']:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
