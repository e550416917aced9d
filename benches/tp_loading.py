"""What background loading costs under tensor parallelism: the agreement on finished reads, over gloo on CPU.

Two parts, at TP = ``--tp`` (one torch thread per rank):

- *Serving*: a tiny Llama, eight adapters, a host tier of two, every read delayed ``--load-ms`` on the
  last rank only; a scheduler loop resubmits deferred requests (and prefetches them) until all ran. Reports
  the steps and their mean time, how many ran the agreement (steps with reads open), its calls and bytes
  (exact: the manager's collective log), and the requests deferred for reads.
- *Agreement alone*: the time of one ``agree_fetches`` all-reduce with 1, 4 and 16 reads open, against an
  all-reduce of one int64 over the same group (the floor of any collective), alternately, median of
  ``--reps`` each.
- *Loading*: one rank's ``LoRAManager.load`` of an r=16 adapter on all 7 modules of a 4-layer Llama (hidden
  1024): it reads and hashes every tensor whole, keeps its shard, and agrees on the outcome and on the
  digest; against the same rank's unsharded ``load_adapter`` of the same files (what one process without
  tensor parallelism reads and hashes), alternately, median of 9 each.

Run: ``.venv/bin/python benches/tp_loading.py`` (``--tp 2``, ``--load-ms 50``, ``--reps 300``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = 8


def _serve(rank: int, size: int, root: Path, load_ms: float) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from lora_pin import LoRAManager
    from lora_pin._testing import slow_store
    from lora_pin.parallel import TensorParallel
    from lora_pin.parallel_fixtures import shard_llama

    tp = TensorParallel(rank, size)
    model = shard_llama(AutoModelForCausalLM.from_pretrained(root / "model").eval(), tp)
    mgr = LoRAManager(
        model, max_loras_per_batch=2, max_loaded_loras=2, max_lora_rank=8, lora_target_modules=ALL, tp=tp
    )
    for i in range(ADAPTERS):
        mgr.load(f"a{i}", root / f"a{i}")
    # The loads above agreed with "agree" calls; only the serving below runs "agree_fetches".
    names = [f"a{i % ADAPTERS}" if i % 4 else None for i in range(32)]
    queue = list(range(len(names)))
    ids = torch.randint(0, 128, (len(names), 1), generator=torch.Generator().manual_seed(0))
    steps = agreeing = deferred = 0
    start = time.perf_counter()
    with slow_store(load_ms if rank == size - 1 else 0), torch.inference_mode():
        while queue:
            before = mgr.stats()["tp_collective_calls"].get("agree_fetches", 0)
            mgr.prefetch([names[i] for i in queue])
            step = mgr.prepare_step([names[i] for i in queue], 1)
            try:
                rows = [queue[i] for i in step.admitted]
                if rows:
                    model(ids[rows])
            finally:
                mgr.finish(step)
            steps += 1
            agreeing += mgr.stats()["tp_collective_calls"].get("agree_fetches", 0) > before
            deferred += len(step.loading)
            queue = [queue[i] for i in step.deferred]
    seconds = time.perf_counter() - start
    stats = mgr.stats()
    mgr.detach()
    return {
        "steps": steps,
        "step_ms": seconds / steps * 1e3,
        "steps_agreeing": agreeing,
        "agree_calls": stats["tp_collective_calls"].get("agree_fetches", 0),
        "agree_bytes": stats["tp_collective_bytes"].get("agree_fetches", 0),
        "requests_deferred_for_reads": deferred,
        "background_loads": stats["background_loads"],
    }


def _agreement_us(rank: int, size: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from lora_pin.parallel import TensorParallel
    from lora_pin.parallel.collective import READ, RUNNING, agree_fetches

    tp = TensorParallel(rank, size)
    floor = torch.zeros(1, dtype=torch.int64)
    out: dict[str, float] = {}
    for n in (1, 4, 16):
        outcomes = [READ if i % 2 else RUNNING for i in range(n)]
        ours, base = [], []
        for _ in range(reps):
            start = time.perf_counter()
            agree_fetches(tp, outcomes)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            dist.all_reduce(floor)
            base.append(time.perf_counter() - start)
        out[f"agree_{n}_us"] = statistics.median(ours) * 1e6
        out[f"floor_{n}_us"] = statistics.median(base) * 1e6
    return out


def _load_ms(rank: int, size: int, root: Path, rounds: int = 9) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from lora_pin import LoRAManager
    from lora_pin.parallel import TensorParallel
    from lora_pin.parallel_fixtures import shard_llama
    from lora_pin.weights import LoRATargets, load_adapter

    tp = TensorParallel(rank, size)
    unsharded = AutoModelForCausalLM.from_pretrained(root / "big").eval()
    targets = LoRATargets.from_model(unsharded)
    model = shard_llama(AutoModelForCausalLM.from_pretrained(root / "big").eval(), tp)
    mgr = LoRAManager(model, max_loras_per_batch=2, max_lora_rank=16, lora_target_modules=ALL, tp=tp)
    ours, base = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        mgr.load("big", root / "big_adapter")
        ours.append(time.perf_counter() - start)
        mgr.unload("big")
        start = time.perf_counter()
        load_adapter("big", root / "big_adapter", targets, max_rank=16, dtype=torch.float32)
        base.append(time.perf_counter() - start)
    mgr.detach()
    return {"tp_load_ms": statistics.median(ours) * 1e3, "unsharded_load_ms": statistics.median(base) * 1e3}


def _rank_main(rank: int, size: int, root: str, port: int, load_ms: float, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        result = _serve(rank, size, Path(root), load_ms)
        result.update(_agreement_us(rank, size, reps))
        result.update(_load_ms(rank, size, Path(root)))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--load-ms", type=float, default=50.0)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_llama(root / "model", heads=4, kv_heads=2, layers=2)
        for i in range(ADAPTERS):
            make_peft_adapter(root / "model", root / f"a{i}", r=8, lora_alpha=16, target_modules=ALL, seed=i)
        make_tiny_llama(root / "big", hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=4)
        make_peft_adapter(root / "big", root / "big_adapter", r=16, lora_alpha=32, target_modules=ALL, seed=9)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = root / "result.json"
        mp.spawn(
            _rank_main,
            args=(args.tp, str(root), port, args.load_ms, args.reps, str(out)),
            nprocs=args.tp,
            join=True,
        )
        result = json.loads(out.read_text())
    print(f"TP={args.tp}, reads delayed {args.load_ms:g} ms on the last rank only")
    print(
        f"serving: {result['steps']} steps of {result['step_ms']:.1f} ms on average, "
        f"{result['steps_agreeing']} ran the agreement; "
        f"{result['agree_calls']} calls, {result['agree_bytes']} B in all "
        f"({result['agree_bytes'] / max(result['agree_calls'], 1):.0f} B a call); "
        f"{result['requests_deferred_for_reads']} request-steps deferred for reads, "
        f"{result['background_loads']} background loads"
    )
    for n in (1, 4, 16):
        ours, floor = result[f"agree_{n}_us"], result[f"floor_{n}_us"]
        print(
            f"agreement, {n:2d} reads open: {ours:7.1f} us; one-int64 all-reduce {floor:7.1f} us "
            f"({ours / floor:.2f}x)"
        )
    tp_ms, one_ms = result["tp_load_ms"], result["unsharded_load_ms"]
    print(
        f"loading (rank 0): a TP={args.tp} load {tp_ms:.1f} ms (whole tensors read and hashed, shard kept, "
        f"outcome and digest agreed); the unsharded load of the same files {one_ms:.1f} ms "
        f"({tp_ms / one_ms:.2f}x)"
    )


if __name__ == "__main__":
    main()
