"""README's quick start, run as written: its first Python block, with the model and adapter paths pointed at
tiny local fixtures ("law", loaded at run time, has a larger rank than the start-up adapters, as a real
deployment's later adapters may), the logits checked against PEFT's mixed-batch forward."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def quick_start() -> str:
    """The first ```python block after README's "## Quick start" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README's quick start has no python block"
    return match.group(1)


def test_the_quick_start_runs_as_written(tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    specs = {
        "math": dict(r=4, lora_alpha=8, target_modules=ATTN, seed=1),
        "chat": dict(r=8, lora_alpha=8, target_modules=ATTN, seed=2),
        "law": dict(r=32, lora_alpha=16, target_modules=ATTN, seed=3),
    }
    paths = make_adapters(tmp_path, specs)
    code = quick_start().replace('"/models/llama"', repr(str(tiny_llama_dir)))
    for name, path in paths.items():
        code = code.replace(f"/adapters/{name}", str(path))
    assert "/adapters/" not in code and "/models/" not in code, code
    input_ids = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(0))
    namespace: dict[str, Any] = {"input_ids": input_ids, "names": ["math", None, "chat", "math"]}
    exec(compile(code, "README.md quick start", "exec"), namespace)

    oracle = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir), str(paths["math"]), adapter_name="math"
    )
    oracle.load_adapter(str(paths["chat"]), adapter_name="chat")
    with torch.no_grad():
        want = oracle(input_ids, adapter_names=["math", "__base__", "chat"]).logits
    torch.testing.assert_close(namespace["logits"], want, rtol=1e-4, atol=1e-5)
    assert "law" not in namespace["mgr"].stats()["host"]["resident"]


@pytest.mark.parametrize("what", ["position_ids", "KV cache"])
def test_the_packing_section_says_what_an_hf_model_needs(what: str) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[
        readme.index("Serving frameworks that pack tokens") : readme.index("### Background loading")
    ]
    assert what in section
