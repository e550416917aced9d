"""The demo's model and adapters, generated locally into a cache folder on first use (no network).

A tiny random Llama-style model and twelve PEFT adapters that cover what real fleets mix: ranks 2 to 16,
rsLoRA, per-module rank and alpha patterns, attention-only and MLP-only targets, a subset of layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = ["DEMO_ADAPTERS", "DemoAssets", "default_cache_dir", "ensure_demo_assets"]

_VERSION = 1
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

#: name -> PEFT LoraConfig keywords; "pinned" marks the two adapters the demo pins.
DEMO_ADAPTERS: dict[str, dict[str, Any]] = {
    "math": {"r": 8, "lora_alpha": 16, "target_modules": _ATTN + _MLP, "pinned": True},
    "chat": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": _ATTN,
        "rank_pattern": {"q_proj": 4},
        "alpha_pattern": {"v_proj": 4},
        "pinned": True,
    },
    "law": {"r": 16, "lora_alpha": 32, "target_modules": _ATTN, "use_rslora": True},
    "code": {"r": 4, "lora_alpha": 8, "target_modules": _MLP},
    "med": {"r": 16, "lora_alpha": 16, "target_modules": _ATTN + _MLP, "layers_to_transform": [0]},
    "poem": {"r": 2, "lora_alpha": 4, "target_modules": ("q_proj", "v_proj")},
    "sql": {"r": 8, "lora_alpha": 8, "target_modules": ("q_proj", "v_proj", "down_proj")},
    "fin": {"r": 16, "lora_alpha": 8, "target_modules": _MLP, "use_rslora": True},
    "bio": {"r": 4, "lora_alpha": 16, "target_modules": ("o_proj", "up_proj")},
    "tutor": {"r": 8, "lora_alpha": 32, "target_modules": _ATTN + _MLP, "rank_pattern": {"down_proj": 16}},
    "news": {"r": 2, "lora_alpha": 2, "target_modules": ("k_proj", "gate_proj")},
    "game": {"r": 16, "lora_alpha": 16, "target_modules": _ATTN + _MLP, "layers_to_transform": [1]},
}


@dataclass(frozen=True)
class DemoAssets:
    """Where the demo's model and adapters are, and the ``--lora-paths`` items that name them."""

    model_dir: Path
    adapter_dirs: dict[str, Path]
    lora_paths: list[str]


def default_cache_dir() -> Path:
    """``$LORA_PIN_CACHE``, else ``$XDG_CACHE_HOME/lora_pin``, else ``~/.cache/lora_pin``."""
    if os.environ.get("LORA_PIN_CACHE"):
        return Path(os.environ["LORA_PIN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lora_pin"


def ensure_demo_assets(cache_dir: Path | None = None) -> DemoAssets:
    """Generate the demo's model and adapters under ``cache_dir`` unless a complete set is already there.

    Raises:
        ImportError: transformers or peft is not installed (they are demo and test dependencies).
        OSError: the cache folder cannot be written.
    """
    root = (cache_dir or default_cache_dir()) / f"demo-v{_VERSION}"
    manifest = root / "manifest.json"
    model_dir = root / "model"
    adapter_dirs = {name: root / "adapters" / name for name in DEMO_ADAPTERS}
    if not manifest.exists():
        _generate(root, model_dir, adapter_dirs)
        manifest.write_bytes(orjson.dumps({"version": _VERSION, "adapters": sorted(DEMO_ADAPTERS)}))
    items = []
    for name, path in adapter_dirs.items():
        if DEMO_ADAPTERS[name].get("pinned"):
            items.append(orjson.dumps({"lora_name": name, "lora_path": str(path), "pinned": True}).decode())
        else:
            items.append(f"{name}={path}")
    return DemoAssets(model_dir, adapter_dirs, items)


def _generate(root: Path, model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama

    root.mkdir(parents=True, exist_ok=True)
    make_tiny_llama(model_dir, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=128, seed=0)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    for seed, (name, spec) in enumerate(DEMO_ADAPTERS.items(), start=1):
        kwargs = {k: v for k, v in spec.items() if k != "pinned"}
        make_peft_adapter(base, adapter_dirs[name], seed=seed, **kwargs)
