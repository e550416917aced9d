"""Run by tests/vllm/test_dora_punica.py in the vLLM venv (no pytest there): vLLM's own LoRA layers (a fused
q/k/v layer with biases, a row-parallel o layer without) over lora_pin's punica wrapper, with DoRA and plain
LoRA adapters in the slots and base rows between them.

argv[1]: a folder holding ``block.pt`` (``weights``: the PEFT block's state dict; ``x`` ``[T, in]``;
``slots``: per row, the slot of its adapter or -1; ``adapters``: the adapter folder names in slots 0, 1,
2, ...; ``swap``: the adapter put into slot 0 for the second step) and the PEFT adapter folders. The
adapters are read by vLLM's own loader (``LoRAModel.from_local_checkpoint``, with the plugin's patches)
and their DoRA factors computed by :func:`lora_pin.vllm.dora.dora_factors`, then put into the slots as
vLLM's manager does. Writes ``out.pt`` there: ``{name: (qkv [T, 40], o [T, 16])}`` for the runs
``dora`` (the mapping above), ``plain`` (the same slots with no DoRA factors given: DoRA adapters served
as plain LoRA), ``base`` (every row -1) and ``swap`` (the second step, slot 0 reassigned), and
``refused``: per adapter folder of ``broken``, what its load raised (``"Type: message"``, or None).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.lora import LoRAConfig
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.lora.layers import LoRAMapping, MergedQKVParallelLinearWithLoRA, RowParallelLinearWithLoRA
from vllm.lora.lora_model import LoRAModel
from vllm.lora.model_manager import LoRAModelManager
from vllm.lora.peft_helper import PEFTHelper
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

from lora_pin.vllm import dora, seams
from lora_pin.vllm.punica import LoraPinPunicaWrapper

folder = Path(sys.argv[1])
spec = torch.load(folder / "block.pt")
weights: dict[str, torch.Tensor] = spec["weights"]
x: torch.Tensor = spec["x"]
IN, SLOTS, VOCAB = x.shape[1], len(spec["adapters"]), 128
# vLLM's CPU path drops a linear layer's plain weight once packed: DoRA's norms need it kept.
os.environ[dora.KEEP_WEIGHTS_ENV] = "1"
seams.install()


def load(name: str, lora_id: int, manager: Any) -> Any:
    """An adapter folder read as vLLM's worker reads it (``WorkerLoRAManager._load_adapter``), with its
    DoRA factors, then packed as vLLM's manager packs it when it registers it."""
    path = str(folder / name)
    helper = PEFTHelper.from_local_dir(path, None)
    helper.validate_legal(manager.lora_config)
    expected = {"q_proj", "k_proj", "v_proj", "o_proj"}
    model = LoRAModel.from_local_checkpoint(
        path, expected, helper, lora_model_id=lora_id, device="cpu", dtype=torch.float32
    )
    magnitudes = getattr(model, "lora_pin_magnitudes", None)
    if magnitudes is not None:
        model.lora_pin_factors = dora.dora_factors(f"adapter {name!r}", manager, model.loras, magnitudes)
    LoRAModelManager._create_merged_loras_inplace(manager, model)
    return model


def put(manager: Any, wrapper: LoraPinPunicaWrapper, slot: int, model: Any, with_dora: bool) -> None:
    """``model`` into ``slot`` as vLLM's ``activate_adapter`` (with the plugin's patch) does."""
    for layer_name, layer in manager.modules.items():
        lora = model.loras.get(layer_name)
        if lora is None:
            layer.reset_lora(slot)
        else:
            layer.set_lora(slot, lora.lora_a, lora.lora_b)
    wrapper.set_slot(slot, SLOTS, seams.adapter_rank(model))
    dora.activate(manager, slot, model if with_dora else SimpleNamespace())


def step(manager: Any, wrapper: LoraPinPunicaWrapper, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [-1 if s < 0 else s + 1 for s in slots]  # adapter id s + 1 sits in slot s
    mapping = [0 if i < 0 else i for i in ids]
    wrapper.update_metadata(
        LoRAMapping(mapping, mapping, is_prefill=True), list(range(1, SLOTS + 1)), SLOTS + 1, VOCAB
    )
    qkv, o = manager.modules["qkv_proj"], manager.modules["o_proj"]
    return qkv(x)[0].clone(), o(x)[0].clone()


with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:0", backend="gloo"
    )
    initialize_model_parallel(1)
    q_out, kv_out = weights["q_proj.weight"].shape[0], weights["k_proj.weight"].shape[0]
    head = kv_out
    qkv_base = QKVParallelLinear(IN, head, q_out // head, 1, bias=True, params_dtype=torch.float32)
    o_base = RowParallelLinear(IN, weights["o_proj.weight"].shape[0], bias=False, params_dtype=torch.float32)
    with torch.no_grad():
        qkv_base.weight.copy_(torch.cat([weights[f"{p}_proj.weight"] for p in "qkv"]))
        qkv_base.bias.copy_(torch.cat([weights[f"{p}_proj.bias"] for p in "qkv"]))
        o_base.weight.copy_(weights["o_proj.weight"])
    lora_config = LoRAConfig(max_lora_rank=8, max_loras=SLOTS, lora_dtype=torch.float32)
    for base_layer in (qkv_base, o_base):
        base_layer.quant_method.process_weights_after_loading(base_layer)
    out: dict[str, Any] = {}
    for run in ("dora", "plain", "base"):
        layers = {
            "qkv_proj": MergedQKVParallelLinearWithLoRA(qkv_base),
            "o_proj": RowParallelLinearWithLoRA(o_base),
        }
        wrapper = LoraPinPunicaWrapper(64, 16, "cpu")
        for layer in layers.values():
            layer.create_lora_weights(SLOTS, lora_config)
            layer.set_mapping(wrapper)
        manager = SimpleNamespace(
            modules=layers,
            packed_modules={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
            lora_config=lora_config,
            is_pooling_model=False,
            _get_lora_layer_weights=lambda model, name: model.get_lora(name),
        )
        models = [load(name, s + 1, manager) for s, name in enumerate(spec["adapters"])]
        for s, model in enumerate(models):
            put(manager, wrapper, s, model, run != "plain")
        slots = [-1] * len(spec["slots"]) if run == "base" else list(spec["slots"])
        out[run] = step(manager, wrapper, slots)
        if run == "dora":
            put(manager, wrapper, 0, load(spec["swap"], 1, manager), True)
            out["swap"] = step(manager, wrapper, slots)
            # Broken adapters: what each load raises (type and message).
            out["refused"] = {}
            for name in spec["broken"]:
                try:
                    load(name, 9, manager)
                    out["refused"][name] = None
                except Exception as e:  # the refusal's type and message are what the test reads
                    out["refused"][name] = f"{type(e).__name__}: {e}"
torch.save(out, folder / "out.pt")
print("done")
