"""What ``LoRAManager.stats()`` costs once many adapter names have come and gone (every metrics scrape
calls it): ``--names`` adapters loaded one after another through a host tier of two, each load evicting
an older one, then ``stats()`` timed against the registry's own ``stats()`` (the Rust part, which
``stats()`` starts from) in the same process, so the ratio is what the Python layer adds.

Run: ``.venv/bin/python benches/stats_many_adapters.py`` (``--names``, default 20,000).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from manager_step import best_us  # benches/ is on the path when a bench runs as a script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--names", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)

    import transformers

    from lora_pin import LoRAManager
    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_llama(root / "base", layers=1, hidden=16, intermediate=32, heads=2, kv_heads=1)
        adapter = make_peft_adapter(base, root / "a", r=1, lora_alpha=2, target_modules=["q_proj"])
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        mgr = LoRAManager(
            model,
            [],
            max_loras_per_batch=1,
            max_loaded_loras=2,
            max_lora_rank=1,
            lora_target_modules=["q_proj"],
        )
        start = time.perf_counter()
        for i in range(args.names):
            mgr.load(f"n{i}", adapter)
        loading = time.perf_counter() - start
        stats = mgr.stats()
        manager_us = best_us(mgr.stats, args.calls)
        registry_us = best_us(mgr.registry.stats, args.calls)
    print(f"{args.names} names loaded through a host tier of 2 in {loading:.1f} s")
    print(f"evictions_by_adapter entries: {len(stats['evictions_by_adapter'])}")
    print(f"LoRAManager.stats(): {manager_us:.0f} us; registry.stats(): {registry_us:.0f} us")
    print(f"ratio manager/registry: {manager_us / registry_us:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
