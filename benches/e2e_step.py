"""One mixed-adapter forward step end to end: ``LoRAManager`` (plan + ops over the slot pool) vs PEFT's own
mixed batch (``model(..., adapter_names=[...])``) on the same Llama-style model, adapters and inputs.

    .venv/bin/python benches/e2e_step.py [--hidden 1024] [--layers 4] [--adapters 8] [--batch 32]

Both are checked equal first (1e-4 relative); then decode (1 token per sequence) and prefill steps are timed,
methods interleaved, best of N, beside the base model alone. Prints milliseconds per step, the LoRA overhead
(step minus base model) of each, and the ratios.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import warnings
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU time (with --threads 1: every kernel runs on it), for a machine "
        "loaded by other jobs",
    )
    args = ap.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    import transformers
    from peft import PeftModel

    from lora_pin import LoRAManager
    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = Path(tempfile.mkdtemp(prefix="lora_pin_e2e_"))
    base_dir = make_tiny_llama(
        root / "base",
        hidden=args.hidden,
        intermediate=args.hidden * 2,
        layers=args.layers,
        heads=8,
        kv_heads=4,
        vocab=1024,
    )
    maker = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    names = [f"a{i}" for i in range(args.adapters)]
    paths = {
        n: make_peft_adapter(
            maker, root / n, r=args.rank, lora_alpha=2 * args.rank, target_modules=modules, seed=i
        )
        for i, n in enumerate(names)
    }
    peft = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir), paths[names[0]], adapter_name=names[0]
    )
    for n in names[1:]:
        peft.load_adapter(paths[n], adapter_name=n)
    peft.eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in paths.items()], max_loras_per_batch=args.adapters + 1)

    rng = random.Random(0)
    seq_names: list[str | None] = [rng.choice([*names, None]) for _ in range(args.batch)]
    peft_names = [n or "__base__" for n in seq_names]

    def ours(ids: torch.Tensor) -> torch.Tensor:
        with mgr.batch(seq_names):
            return model(ids).logits

    def theirs(ids: torch.Tensor) -> torch.Tensor:
        return peft(ids, adapter_names=peft_names).logits

    def base(ids: torch.Tensor) -> torch.Tensor:
        return model(ids).logits  # no active step: the wrapped model is the base model

    base_rows = sum(n is None for n in seq_names)
    print(
        f"hidden {args.hidden}, {args.layers} layers, {args.adapters} adapters of rank {args.rank} on all 7 "
        f"modules, batch {args.batch} ({base_rows} base rows), {args.threads} thread(s)"
    )
    with torch.inference_mode():
        for phase, length in (("decode", 1), ("prefill", args.prefill)):
            ids = torch.randint(0, 1024, (args.batch, length), generator=torch.Generator().manual_seed(1))
            got, want = ours(ids), theirs(ids)
            err = float((got - want).abs().max() / want.abs().max())
            assert err <= 1e-4, f"{phase}: lora_pin and PEFT differ (relative {err:.2e})"
            fns = [("lora_pin", ours), ("peft", theirs), ("base", base)]
            best = dict.fromkeys([name for name, _ in fns], float("inf"))
            for r in range(args.rounds):
                for i in range(len(fns)):
                    name, fn = fns[(r + i) % len(fns)]
                    t0 = clock()
                    fn(ids)
                    best[name] = min(best[name], clock() - t0)
            ms = {k: v * 1e3 for k, v in best.items()}
            ours_extra, peft_extra = ms["lora_pin"] - ms["base"], ms["peft"] - ms["base"]
            print(
                f"  {phase:<8} step: lora_pin {ms['lora_pin']:.2f} ms, peft {ms['peft']:.2f} ms, base model "
                f"{ms['base']:.2f} ms ({ms['peft'] / ms['lora_pin']:.2f}x)"
            )
            print(
                f"  {phase:<8} LoRA overhead over the base model: lora_pin {ours_extra:.2f} ms, peft "
                f"{peft_extra:.2f} ms ({peft_extra / max(ours_extra, 1e-9):.2f}x); "
                f"max relative difference {err:.1e}"
            )


if __name__ == "__main__":
    main()
