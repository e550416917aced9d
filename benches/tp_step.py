"""What tensor parallelism costs the LoRA path, per step and mode, on CPU over gloo.

A Llama-style model (default hidden 512, 4 layers, 8 heads, 2 kv heads; every projection targeted at rank
16) serves a decode step (16 sequences, one token) and a prefill step (4 x 64 tokens), each with a quarter
of the rows on the base model and four adapters. For each configuration (TP = 1 unsharded, then TP = 2 and
4, plain and fully sharded) it times the step with adapters and the same batch with every row on the base
model alternately (fastest of ``--reps`` each), one torch thread per rank, and reports the LoRA overhead
(the difference) beside TP = 1's, the collectives the LoRA layers ran per step (calls and bytes sent by one
rank) against the base model's own all-reduces, and each rank's host and device-pool bytes.
Configurations run in turn, ``--rounds`` times, so a noisy neighbour hits them alike.

Run: ``.venv/bin/python benches/tp_step.py`` (``--tp 2,4``, ``--hidden``, ``--rank``, ``--rounds``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _step_ms(model: Any, mgr: Any, ids: Any, names: list[str | None]) -> float:
    import torch

    with torch.inference_mode(), mgr.batch(names):
        start = time.perf_counter()
        model(ids)
        return (time.perf_counter() - start) * 1e3


def _alternate(model: Any, mgr: Any, ids: Any, names: list[str | None], reps: int) -> tuple[float, float]:
    """Fastest step with adapters and fastest all-base step, timed alternately (a neighbour's burst hits
    both alike); every rank runs the same sequence, so the collectives pair up."""
    lora, base = [], []
    for _ in range(reps):
        lora.append(_step_ms(model, mgr, ids, names))
        base.append(_step_ms(model, mgr, ids, [None] * len(names)))
    return min(lora), min(base)


def _rank_main(rank: int, size: int, fully: bool, root: str, port: int, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from lora_pin import LoRAManager
    from lora_pin.parallel import TensorParallel
    from lora_pin.parallel_fixtures import shard_llama

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(Path(root) / "model").eval()
        tp = None if size == 1 else TensorParallel(rank, size, fully_sharded=fully)
        if tp is not None:
            model = shard_llama(model, tp)
        items = [f"a{i}={Path(root) / f'a{i}'}" for i in range(4)]
        mgr = LoRAManager(model, items, max_loras_per_batch=4, max_lora_rank=16, tp=tp)
        config = model.config
        result: dict[str, Any] = {
            "host_kib": mgr.stats()["host_bytes"] / 4 / 1024,
            "pool_kib": mgr.pool.nbytes / 1024,
        }
        generator = torch.Generator().manual_seed(0)
        for kind, batch, length in (("decode", 16, 1), ("prefill", 4, 64)):
            names: list[str | None] = [None if i % 4 == 3 else f"a{i % 4}" for i in range(batch)]
            ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
            _alternate(model, mgr, ids, names, 3)  # warm-up
            before = mgr.stats()
            lora, base = _alternate(model, mgr, ids, names, reps)
            after = mgr.stats()
            # Both timings ran reps steps each; the all-base steps run no LoRA collective.
            calls, sent = {}, {}
            for key, into in (("tp_collective_calls", calls), ("tp_collective_bytes", sent)):
                for kind_name, count in after.get(key, {}).items():
                    into[kind_name] = (count - before[key].get(kind_name, 0)) / reps
            tokens = batch * length
            # The base model's own all-reduces: o_proj and down_proj of every layer, [T, hidden] fp32.
            base_bytes = 2 * config.num_hidden_layers * tokens * config.hidden_size * 4 if tp else 0
            result[kind] = {
                "lora_ms": lora,
                "base_ms": base,
                "calls": calls,
                "bytes": sent,
                "base_allreduce_calls": 2 * config.num_hidden_layers if tp else 0,
                "base_allreduce_bytes": base_bytes,
            }
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(size: int, fully: bool, root: Path, reps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = root / f"result-{size}-{int(fully)}.json"
    mp.spawn(_rank_main, args=(size, fully, str(root), port, reps, str(out)), nprocs=size, join=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", default="2,4", help="tensor-parallel sizes besides 1 (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    import transformers

    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

    transformers.logging.set_verbosity_error()
    configs = [(1, False)] + [(int(n), fully) for n in args.tp.split(",") for fully in (False, True)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_llama(
            root / "model",
            hidden=args.hidden,
            intermediate=args.hidden * 2,
            layers=args.layers,
            heads=8,
            kv_heads=2,
            vocab=256,
        )
        for i in range(4):
            make_peft_adapter(
                root / "model", root / f"a{i}", r=args.rank, lora_alpha=32, target_modules=ALL, seed=i
            )
        runs: dict[tuple[int, bool], list[dict[str, Any]]] = {c: [] for c in configs}
        for _ in range(args.rounds):
            for config in configs:
                runs[config].append(_run(*config, root, args.reps))
    print(f"hidden {args.hidden}, {args.layers} layers, rank {args.rank}, 1 torch thread per rank, ", end="")
    print(f"{args.rounds} rounds")
    print("\nper rank: host KiB per adapter, device pool KiB (4 slots)")
    for (size, fully), results in runs.items():
        name = f"TP={size}" + (" fully" if fully else "")
        print(f"{name:<18}{results[0]['host_kib']:>9.1f}{results[0]['pool_kib']:>10.1f}")
    for kind in ("decode", "prefill"):
        one = min(r[kind]["lora_ms"] - r[kind]["base_ms"] for r in runs[(1, False)])
        print(f"\n{kind}: LoRA overhead = step with adapters - same step all base (best of rounds)")
        header = f"{'config':<18}{'base ms':>9}{'lora ms':>9}{'overhead':>10}{'vs TP=1':>9}"
        print(f"{header}  LoRA collectives / step")
        for (size, fully), results in runs.items():
            best = min(results, key=lambda r: r[kind]["lora_ms"] - r[kind]["base_ms"])[kind]
            overhead = best["lora_ms"] - best["base_ms"]
            name = f"TP={size}" + (" fully" if fully else "")
            moved = ", ".join(
                f"{k} {v:.0f} x / {best['bytes'][k] / 1024:.1f} KiB" for k, v in best["calls"].items() if v
            )
            base_kib = best["base_allreduce_bytes"] / 1024
            base = f"(base: {best['base_allreduce_calls']} all-reduce / {base_kib:.0f} KiB)"
            print(
                f"{name:<18}{best['base_ms']:>9.2f}{best['lora_ms']:>9.2f}{overhead:>10.2f}"
                f"{overhead / one:>8.2f}x  {moved or 'none'} {base if size > 1 else ''}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
