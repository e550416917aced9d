"""``vllm serve --lora-target-modules`` (LoRA buffers on the named modules only: smaller slots): with the
plugin, adapters within the targets equal PEFT's greedy tokens beside base requests, and an adapter with
weights outside them is refused at load, naming the adapter and the modules, while the server serves on;
vLLM alone serves such an adapter without those weights (asserted, so that an upstream fix is noticed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_mixed_batches import SERVER_ARGS
from vllm_harness import Oracle, VllmServer, concurrent_mix, prompt

# Adapters ad1, ad4 and ad7 of the world are on q_proj and v_proj only; the others on every linear layer.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = ("--lora-target-modules", *ATTENTION)


def _attention_only(world: tuple[Path, dict[str, Path]]) -> dict[str, Path]:
    return {name: world[1][name] for name in ("ad1", "ad4", "ad7")}


@pytest.fixture(scope="module")
def server(make_server: Callable[..., VllmServer], vllm_world: tuple[Path, dict[str, Path]]) -> VllmServer:
    return make_server(True, *SERVER_ARGS, *TARGETS, dirs=_attention_only(vllm_world))


def test_adapters_within_the_targets_beside_base_requests_equal_peft(
    server: VllmServer, oracle: Oracle
) -> None:
    # 12 requests over the base model and 3 adapters, 2 slots, all sent at once.
    assert concurrent_mix(server, oracle) == []


def test_the_slots_memory_is_logged_as_the_targets_make_it(server: VllmServer) -> None:
    # The world's model: hidden 64, q 2 heads of 32, k and v 1 head, 2 layers; --max-lora-rank 8,
    # --max-loras 2, float32. A slot holds A [8, in] and B [out, 8] for q, k, v (fused) and o in each
    # layer: 8 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)) elements, 4 bytes each.
    per_slot = 2 * 8 * (128 + 96 + 96 + 128) * 4
    line = (
        f"lora_pin: LoRA buffers: 2 slots of {per_slot:,} bytes ({per_slot / 2**20:.1f} MiB), "
        f"{2 * per_slot / 2**20:.1f} MiB in all, on 4 modules (--lora-target-modules k_proj o_proj "
        "q_proj v_proj)"
    )
    assert line in server.log.read_text(errors="replace")


def test_an_adapter_outside_the_targets_is_refused_naming_its_modules(
    server: VllmServer, oracle: Oracle, vllm_world: tuple[Path, dict[str, Path]]
) -> None:
    message = server.refused_load("ad2", vllm_world[1]["ad2"])
    assert "adapter 'ad2'" in message
    # 2 layers of gate_proj, up_proj and down_proj: 6 modules, the first three named.
    assert "6 modules outside --lora-target-modules k_proj o_proj q_proj v_proj" in message
    assert "'model.layers.0.mlp.down_proj'" in message
    assert "and 3 more" in message
    assert server.complete("ad4", prompt(5), 8) == oracle.tokens(server.dirs["ad4"], prompt(5), 8)


def _without_mlp(folder: Path, to: Path) -> Path:
    """A copy of the PEFT adapter in ``folder`` with its tensors on :data:`ATTENTION` modules only."""
    import safetensors.torch

    to.mkdir()
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = ATTENTION
    (to / "adapter_config.json").write_text(json.dumps(config))
    tensors = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    kept = {k: v for k, v in tensors.items() if any(f".{m}." in k for m in ATTENTION)}
    assert 0 < len(kept) < len(tensors)
    safetensors.torch.save_file(kept, to / "adapter_model.safetensors")
    return to


def test_vllm_alone_serves_it_without_the_weights_outside(
    make_server: Callable[..., VllmServer],
    oracle: Oracle,
    vllm_world: tuple[Path, dict[str, Path]],
    tmp_path: Path,
) -> None:
    folder = vllm_world[1]["ad2"]
    assert json.loads((folder / "adapter_config.json").read_text())["target_modules"]
    alone = make_server(False, *SERVER_ARGS, *TARGETS, dirs={"ad2": folder})
    served = alone.complete("ad2", prompt(3), 8)
    assert served != oracle.tokens(folder, prompt(3), 8)
    assert served == oracle.tokens(_without_mlp(folder, tmp_path / "ad2-attention"), prompt(3), 8)
