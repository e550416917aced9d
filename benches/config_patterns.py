"""How long an adapter config's regexes take to match: a pattern exponential for backtracking, and a config
with many ``rank_pattern`` keys, each through ``load_adapter`` on a tiny Llama (2 layers, 14 linears).

* exponential: ``target_modules = "(?:.|.)" * K + "X"``, which matches no module, so the load is refused;
  a backtracking engine tries 2^K ways per module name before it can say so.
* many keys: ``rank_pattern`` with ``--keys`` entries ``"<module>|u<i>"``, each matching one of the seven
  linear names (so every key is in use, as ``load_adapter`` requires); timed through a full
  ``load_adapter`` (read, parse, compile, match every module, build the host tensors) and, to show what the
  patterns cost, against the same adapter without ``rank_pattern``. The default, 4,089 keys, puts the
  config at ``MAX_PATTERN_ENTRIES`` with its seven ``target_modules`` names; above it the config is refused,
  and the time to refuse it is printed.
* per module key, for 4,096 patterns matched as ``rank_pattern`` keys against an 80-layer Llama's keys
  (``base_model.model.model.layers.N.self_attn.q_proj``): full module names, and patterns built to defeat
  the lazy DFA's cache (``.*[a-z].{k}q``), the engine's worst case within the limits.

    .venv/bin/python benches/config_patterns.py --k 26 --keys 4089
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from lora_pin._core import PatternSet
from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.weights import LoRATargets, load_adapter

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def time_exponential(targets: LoRATargets, adapter: Path, k: int) -> float:
    """Seconds for ``load_adapter`` to refuse ``adapter`` with ``target_modules`` set to the 2^K pattern
    (it matches no module of the model)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = "(?:.|.)" * k + "X"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    try:
        load_adapter("exp", adapter, targets, max_rank=8, dtype=torch.float32)
    except AdapterLoadError:
        return time.perf_counter() - start
    raise AssertionError("the 2^K pattern matches no module, so the adapter must be refused")


def copy_adapter(source: Path, target: Path) -> Path:
    """A copy of the adapter folder ``source`` at ``target``."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def time_many_keys(targets: LoRATargets, plain: Path, keys: int, repeats: int) -> tuple[float, float, bool]:
    """Best-of-``repeats`` seconds of ``load_adapter`` with ``keys`` rank_pattern keys and without them, and
    whether the adapter with them was refused."""
    patterned = copy_adapter(plain, plain.parent / "patterned")
    config = json.loads((plain / "adapter_config.json").read_text())
    config["rank_pattern"] = {f"{LINEARS[i % len(LINEARS)]}|u{i}": 8 for i in range(keys)}
    (patterned / "adapter_config.json").write_text(json.dumps(config))

    refused = False

    def best(path: Path) -> float:
        nonlocal refused
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            try:
                load_adapter("a", path, targets, max_rank=8, dtype=torch.float32)
            except AdapterLoadError:
                refused = True
            times.append(time.perf_counter() - start)
        return min(times)

    return best(patterned), best(plain), refused


def time_per_key(patterns: list[str], keys: list[str]) -> tuple[float, float]:
    """Seconds to compile ``patterns`` as rank_pattern keys, and milliseconds per key to match ``keys``."""
    start = time.perf_counter()
    matcher = PatternSet(patterns, anchoring="dotted_suffix")
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    matcher.used_by(keys)
    return compiled, (time.perf_counter() - start) / len(keys) * 1e3


def main() -> None:
    """Build a tiny Llama and an adapter on all its linears, print the two timings."""
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=26)
    parser.add_argument("--keys", type=int, default=4089)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = AutoModelForCausalLM.from_pretrained(make_tiny_llama(root / "base", layers=2))
        targets = LoRATargets.from_model(base)
        plain = make_peft_adapter(base, root / "plain", r=8, lora_alpha=16, target_modules=LINEARS)
        refused = time_exponential(targets, copy_adapter(plain, root / "exp"), args.k)
        print(f"load_adapter refusing target_modules = '(?:.|.)' * {args.k} + 'X': {refused:.3f} s")
        with_keys, without, refused = time_many_keys(targets, plain, args.keys, args.repeats)
    groups = ["self_attn"] * 4 + ["mlp"] * 3
    names = [f"layers.{i % 80}.{groups[i % 7]}.{LINEARS[i % 7]}" for i in range(4096)]
    keys = [f"base_model.model.model.{n}" for n in names[:560]]
    full_names = [n.replace(".", "\\.") + f"|x{i}" for i, n in enumerate(names)]
    adversarial = [f".*[a-z{chr(97 + i % 26)}].{{{5 + i % 30}}}q" for i in range(4096)]
    for what, patterns, sample in (
        ("full module names", full_names, keys),
        ("built to defeat the DFA", adversarial, keys[:20]),
    ):
        compiled, per_key = time_per_key(patterns, sample)
        print(
            f"4096 rank_pattern keys, {what}: compiled in {compiled:.3f} s, {per_key:.3f} ms per module key"
        )
    print(
        f"load_adapter with {args.keys} rank_pattern keys: {with_keys:.3f} s"
        f"{' (refused)' if refused else ''}; without rank_pattern: {without:.3f} s (best of {args.repeats})"
    )


if __name__ == "__main__":
    main()
