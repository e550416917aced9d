"""Load N PEFT adapters from disk into the host tier and the device pool, against two baselines.

Baselines, in the same process, on the same files (warm in the page cache after a first untimed pass):

* floor: ``safetensors.torch.load_file`` + ``copy_`` of every tensor into preallocated tensors of the same
  shapes (what any loader must at least do: read the bytes and put them somewhere);
* PEFT: ``PeftModel.load_adapter`` of each adapter into one already-wrapped model.

lora_pin: ``load_adapter`` (config checks, PEFT matching, shape checks, normalisation into the host tier,
and the content digest: every served byte hashed with BLAKE3 by the core as it is read) followed by
``DevicePool.fill`` into slot i (zeroing what the adapter does not cover). The goal against the floor is for
the host tier alone (``load_adapter``), which reads each byte once, as the floor does; the pool fill is a
second copy the floor does not make. Also timed: hashing every adapter's tensors alone (the Python
``blake3`` package, one thread); and the host tier with its reads on one thread
(``reader.READ_THREADS = 1``, patched in here), to show what the core's other reading threads bring;
and the host tier with nothing decided before (``cold``): the adapters here are alike (one config, one
header), so after the first every load reuses the first one's checks and layout (the reader's header
index and the read recipe of ``weights/read_recipes.py``); ``cold`` drops both before each adapter, and the
rank and scaling tensors kept by value, as a load of adapters of eight different recipes (of different
ranks or alphas) would find them.

The loaders run in alternating rounds (floor, host tier, one thread, host tier + pool, PEFT, hashing; each
timed as the median of ``--repeats`` runs); every ratio is taken within a round, and the median over
``--rounds`` is reported, so load from other processes on the machine shifts both sides of a ratio alike.

    .venv/bin/python benches/load_adapters.py --adapters 8 --layers 4 --hidden 1024 --rank 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.weights import DevicePool, LoRATargets, load_adapter, read_recipes, reader
from lora_pin.weights.digest import tensor_digest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# The clock every loader is timed by: the wall clock, or this thread's CPU time (``--cpu-time``).
CLOCK = time.perf_counter


def median_seconds(fn: Callable[[], None], repeats: int, reset: Callable[[], None] | None = None) -> float:
    """The median time of ``fn`` by :data:`CLOCK` over ``repeats`` runs (``reset`` runs untimed before
    each)."""
    times = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times)


def main() -> None:
    """Build the model and adapters in a temporary directory, time the three loaders, print ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU time with every read on it (reader.READ_THREADS = 1): on a machine "
        "loaded by other jobs, where the wall clock swings between runs",
    )
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.thread_time

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_dir = make_tiny_llama(
            root / "base",
            hidden=args.hidden,
            intermediate=args.intermediate,
            layers=args.layers,
            heads=16,
            kv_heads=4,
        )
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        targets = LoRATargets.from_model(base)
        paths = [
            make_peft_adapter(
                base, root / f"a{i}", r=args.rank, lora_alpha=2 * args.rank, target_modules=ALL, seed=i
            )
            for i in range(args.adapters)
        ]
        dtype = torch.float32
        device = torch.device(args.device)

        # lora_pin: host tier + pool
        pool = DevicePool(targets, slots=args.adapters, max_rank=args.rank, dtype=dtype, device=device)

        def lora_pin_load() -> None:
            for i, path in enumerate(paths):
                pool.fill(i, load_adapter(f"a{i}", path, targets, max_rank=args.rank, dtype=dtype))
            if device.type == "cuda":
                torch.cuda.synchronize()

        # floor: load_file + copy into preallocated tensors
        first = load_file(paths[0] / "adapter_model.safetensors")
        prealloc = [{k: torch.empty_like(v, device=device) for k, v in first.items()} for _ in paths]

        def host_load() -> None:
            for i, path in enumerate(paths):
                load_adapter(f"a{i}", path, targets, max_rank=args.rank, dtype=dtype)

        def forget_decisions() -> None:
            # Private on purpose: the caches have no public switch, a benchmark of their absence needs one.
            targets.__dict__.pop("_read_recipes", None)
            reader._INDEXED = reader._IndexCache(32)
            read_recipes._group_tensors.cache_clear()

        def cold_load() -> None:
            for i, path in enumerate(paths):
                forget_decisions()
                load_adapter(f"a{i}", path, targets, max_rank=args.rank, dtype=dtype)

        def floor_load() -> None:
            for i, path in enumerate(paths):
                state = load_file(path / "adapter_model.safetensors")
                dest = prealloc[i]
                for key, tensor in state.items():
                    dest[key].copy_(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize()

        # PEFT: load_adapter into one wrapped model
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir).to(device), paths[0], adapter_name="warm"
        )

        def peft_reset() -> None:
            for name in [n for n in peft_model.peft_config if n != "warm"]:
                peft_model.delete_adapter(name)

        def peft_load() -> None:
            for i, path in enumerate(paths):
                peft_model.load_adapter(path, adapter_name=f"a{i}")
            if device.type == "cuda":
                torch.cuda.synchronize()

        def hash_only() -> None:
            for state in states:
                for key, tensor in state.items():
                    tensor_digest(key, "F32", tuple(tensor.shape), tensor.view(torch.uint8).numpy().data)

        states = [load_file(path / "adapter_model.safetensors") for path in paths]
        for fn in (lora_pin_load, floor_load):
            fn()  # warm the page cache and allocators
        peft_reset()
        peft_load()
        if args.cpu_time:
            # Reads on other threads would escape this thread's CPU time.
            reader.READ_THREADS = 1
        threads = reader.READ_THREADS
        keys = ("ours", "host", "one_thread", "cold", "floor", "peft", "hash")
        rounds: dict[str, list[float]] = {k: [] for k in keys}
        for _ in range(args.rounds):
            rounds["floor"].append(median_seconds(floor_load, args.repeats))
            rounds["host"].append(median_seconds(host_load, args.repeats))
            reader.READ_THREADS = 1
            try:
                rounds["one_thread"].append(median_seconds(host_load, args.repeats))
            finally:
                reader.READ_THREADS = threads
            rounds["cold"].append(median_seconds(cold_load, args.repeats))
            rounds["ours"].append(median_seconds(lora_pin_load, args.repeats))
            rounds["peft"].append(median_seconds(peft_load, args.repeats, reset=peft_reset))
            rounds["hash"].append(median_seconds(hash_only, args.repeats))
        mib = sum((p / "adapter_model.safetensors").stat().st_size for p in paths) / 2**20

    def ratio(top: str, bottom: str) -> float:
        return statistics.median(a / b for a, b in zip(rounds[top], rounds[bottom], strict=True))

    ours, host, floor, peft, hashed = (
        statistics.median(rounds[k]) for k in ("ours", "host", "floor", "peft", "hash")
    )
    n = args.adapters
    print(
        f"{n} adapters, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"r={args.rank}, all 7 modules, fp32, {mib:.1f} MiB on disk, device {device}, "
        f"{args.rounds} alternating rounds of median-of-{args.repeats} (times: medians over rounds)"
    )
    print(f"  lora_pin host tier + pool : {ours * 1e3:8.2f} ms  ({ours / n * 1e3:.2f} ms/adapter)")
    print(
        f"  lora_pin host tier only   : {host * 1e3:8.2f} ms  ({host / n * 1e3:.2f} ms/adapter), with digest"
    )
    print(f"  floor load_file + copy_   : {floor * 1e3:8.2f} ms  ({floor / n * 1e3:.2f} ms/adapter)")
    print(f"  PEFT load_adapter         : {peft * 1e3:8.2f} ms  ({peft / n * 1e3:.2f} ms/adapter)")
    print(f"  BLAKE3 of every tensor    : {hashed * 1e3:8.2f} ms  (one thread, alone)")
    print(
        f"  host tier, reads on one thread : {statistics.median(rounds['one_thread']) * 1e3:8.2f} ms "
        f"(READ_THREADS={threads} above); median of per-round ratios: one thread / floor = "
        f"{ratio('one_thread', 'floor'):.2f}x"
    )
    print(
        f"  host tier, nothing decided before : {statistics.median(rounds['cold']) * 1e3:8.2f} ms; "
        f"median of per-round ratios: cold / floor = {ratio('cold', 'floor'):.2f}x"
    )
    print(
        f"  median of per-round ratios: host tier / floor = {ratio('host', 'floor'):.2f}x (goal <= 1.3x); "
        f"lora_pin / floor = {ratio('ours', 'floor'):.2f}x; PEFT / lora_pin = {ratio('peft', 'ours'):.1f}x "
        f"(goal >= 10x); hashing alone / floor = {ratio('hash', 'floor'):.2f}x"
    )


if __name__ == "__main__":
    main()
