"""DoRA adapters in vLLM's own LoRA layers over lora_pin's punica wrapper, against PEFT's DoRA layers, row by
row, in a batch mixing DoRA, plain LoRA and base rows (``in_vllm/dora_check.py`` runs the vLLM side in the
vLLM venv; PEFT's forward runs here). No server: the layer math and the load-time factors alone."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import torch

from lora_pin.fixtures import save_peft_adapter

CHECK = Path(__file__).parent / "in_vllm" / "dora_check.py"
IN = 32
# Per row: the slot of its adapter (-1: base). Slots 0 and 2 hold DoRA adapters, slot 1 a plain one.
SLOTS = (0, -1, 1, 2, 2, -1, 0, 1, 2, 0, -1)
ADAPTERS = ("dora_all", "lora", "dora_qv")


class Block(torch.nn.Module):
    """A fused-q/k/v attention's projections as PEFT sees them (separate ``q_proj``, ``k_proj``,
    ``v_proj`` with biases; vLLM fuses them into one ``qkv_proj`` of three slices) and an ``o_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(IN, 24)
        self.k_proj = torch.nn.Linear(IN, 8)
        self.v_proj = torch.nn.Linear(IN, 8)
        self.o_proj = torch.nn.Linear(IN, 16, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1), self.o_proj(x)


@pytest.fixture(scope="module")
def outputs(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """``{"vllm": the vLLM side's runs, "peft": adapter name (None: base) -> PEFT's (qkv, o) on x}``."""
    from peft import PeftModel

    torch.manual_seed(0)
    block = Block().eval()
    folder = tmp_path_factory.mktemp("vllm-dora-layer")
    everything = ["q_proj", "k_proj", "v_proj", "o_proj"]
    dirs = {
        # Every projection, o_proj at its own rank (rank_pattern).
        "dora_all": save_peft_adapter(
            block,
            folder / "dora_all",
            1,
            r=4,
            lora_alpha=8,
            target_modules=everything,
            rank_pattern={"o_proj": 2},
            use_dora=True,
        ),
        "lora": save_peft_adapter(block, folder / "lora", 2, r=8, lora_alpha=16, target_modules=everything),
        # q and v only: the fused layer's k slice has no LoRA in this slot. rsLoRA scaling.
        "dora_qv": save_peft_adapter(
            block,
            folder / "dora_qv",
            3,
            r=8,
            lora_alpha=4,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
            use_dora=True,
        ),
        "lora_swap": save_peft_adapter(
            block, folder / "lora_swap", 4, r=2, lora_alpha=2, target_modules=everything
        ),
    }
    broken = break_copies(dirs["dora_all"], folder)
    x = torch.randn(len(SLOTS), IN)
    spec = {
        "weights": block.state_dict(),
        "x": x,
        "slots": SLOTS,
        "adapters": ADAPTERS,
        "swap": "lora_swap",
        "broken": broken,
    }
    torch.save(spec, folder / "block.pt")
    done = subprocess.run(
        [str(vllm_python), str(CHECK), str(folder)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    peft: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        peft[None] = block(x)
        for name, path in dirs.items():
            peft[name] = PeftModel.from_pretrained(copy.deepcopy(block), str(path)).eval()(x)
    return {"vllm": torch.load(folder / "out.pt"), "peft": peft}


MAGNITUDE = "base_model.model.{}.lora_magnitude_vector"


def break_copies(good: Path, folder: Path) -> list[str]:
    """Copies of the DoRA adapter at ``good``, each broken one way; returns their folder names."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(good / "adapter_model.safetensors"))
    config = json.loads((good / "adapter_config.json").read_text())
    nan = dict(tensors)
    nan[MAGNITUDE.format("v_proj")] = nan[MAGNITUDE.format("v_proj")].clone()
    nan[MAGNITUDE.format("v_proj")][3] = float("nan")
    short = dict(tensors)
    short[MAGNITUDE.format("k_proj")] = short[MAGNITUDE.format("k_proj")][:-1].clone()
    variants = {
        "no_magnitude": ({k: v for k, v in tensors.items() if k != MAGNITUDE.format("q_proj")}, config),
        "nan_magnitude": (nan, config),
        "short_magnitude": (short, config),
        "magnitude_without_dora": (tensors, {**config, "use_dora": False}),
    }
    for name, (weights, cfg) in variants.items():
        shutil.copytree(good, folder / name)
        save_file(weights, str(folder / name / "adapter_model.safetensors"))
        (folder / name / "adapter_config.json").write_text(json.dumps(cfg))
    return list(variants)


def rows_of(slot: int) -> list[int]:
    return [t for t, s in enumerate(SLOTS) if s == slot]


@pytest.mark.parametrize("run", ["dora", "swap"])
def test_each_row_equals_peft(outputs: dict, run: str) -> None:
    # swap: slot 0's DoRA adapter replaced by a plain one (the slot's DoRA flag must go with it).
    served = dict(enumerate(ADAPTERS))
    if run == "swap":
        served[0] = "lora_swap"
    for slot, name in [(-1, None), *served.items()]:
        rows = rows_of(slot)
        for got, want in zip(outputs["vllm"][run], outputs["peft"][name], strict=True):
            error = float((got[rows].double() - want[rows].double()).abs().max())
            assert error < 1e-5, (run, name, error)


def test_base_rows_are_bit_identical_to_a_base_only_run(outputs: dict) -> None:
    base = rows_of(-1)
    for got, alone in zip(outputs["vllm"]["dora"], outputs["vllm"]["base"], strict=True):
        assert torch.equal(got[base], alone[base])


def test_plain_lora_rows_are_bit_identical_to_a_run_without_dora(outputs: dict) -> None:
    # "plain": the same batch with the DoRA adapters given no factors (served as plain LoRA).
    rows = rows_of(1)
    for got, without in zip(outputs["vllm"]["dora"], outputs["vllm"]["plain"], strict=True):
        assert torch.equal(got[rows], without[rows])


def test_dora_rows_differ_from_plain_lora(outputs: dict) -> None:
    # The factors are far from 1 (save_peft_adapter spreads the magnitudes): a rescale skipped shows.
    rows = rows_of(0) + rows_of(2)
    for got, without in zip(outputs["vllm"]["dora"], outputs["vllm"]["plain"], strict=True):
        assert float((got[rows] - without[rows]).abs().max()) > 1e-2


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("no_magnitude", ["adapter 'no_magnitude'", "module 'q_proj' has no lora_magnitude_vector"]),
        ("nan_magnitude", ["adapter 'nan_magnitude'", "module 'v_proj'", "NaN/Inf"]),
        ("short_magnitude", ["adapter 'short_magnitude'", "module 'k_proj'", "shape [7], expected [8]"]),
        ("magnitude_without_dora", ["is a DoRA magnitude", "no use_dora: true"]),
    ],
)
def test_a_broken_dora_adapter_is_refused_naming_what(outputs: dict, name: str, words: list[str]) -> None:
    refused = outputs["vllm"]["refused"][name]
    assert refused is not None and refused.startswith("AdapterLoadError: "), refused
    for word in words:
        assert word in refused, (word, refused)
