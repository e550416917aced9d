"""Resident memory over load/unload cycles of one adapter in a serving LoRAManager: the slope says whether
anything leaks per load (issue 14, item 10: safetensors 0.8's ``get_tensor(framework="pt")`` leaked ~64 B
per tensor read, +3.5 MiB per 2,000 cycles).

Prints RSS every ``--every`` cycles, the growth after the warm-up and the least-squares slope in bytes per
cycle. Same workload as ``tests/model/test_reliability.py``'s cycle test: a 2-layer tiny Llama, two resident
adapters, and an r=2 adapter on the 3 MLP linears loaded and unloaded again and again.

    .venv/bin/python benches/load_cycles.py --cycles 10000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from lora_pin import LoRAManager
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def rss_bytes() -> int:
    """This process's resident set size (Linux)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of ``(cycle, rss)`` points, in bytes per cycle."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def main() -> None:
    """Build the model and adapters in a temporary folder, cycle, print the RSS figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1_000)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_dir = make_tiny_llama(root / "base", layers=2)
        maker = AutoModelForCausalLM.from_pretrained(base_dir)
        paths = {
            "a": make_peft_adapter(maker, root / "a", r=4, lora_alpha=8, target_modules=ATTN + MLP, seed=1),
            "b": make_peft_adapter(maker, root / "b", r=8, lora_alpha=4, target_modules=ATTN, seed=2),
            "c": make_peft_adapter(maker, root / "c", r=2, lora_alpha=2, target_modules=MLP, seed=3),
        }
        model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        mgr = LoRAManager(
            model,
            [f"{n}={paths[n]}" for n in ("a", "b")],
            max_loras_per_batch=2,
            max_lora_rank=8,
            lora_target_modules=ATTN + MLP,
            max_loaded_loras=3,
        )
        warmup = args.cycles // 10
        points: list[tuple[int, int]] = []
        started = time.monotonic()
        for cycle in range(args.cycles + 1):
            if cycle >= warmup and (cycle - warmup) % args.every == 0:
                points.append((cycle, rss_bytes()))
                print(f"cycle {cycle:>6}: rss {points[-1][1] / 2**20:8.2f} MiB", flush=True)
            if cycle == args.cycles:
                break
            mgr.load("c", paths["c"])
            mgr.unload("c")
        seconds = time.monotonic() - started
    growth = points[-1][1] - points[0][1]
    print(
        f"{args.cycles} cycles in {seconds:.1f} s; after {warmup} warm-up cycles RSS grew "
        f"{growth / 2**20:.2f} MiB; slope {slope(points):.1f} B/cycle"
    )


if __name__ == "__main__":
    main()
