"""Tensor-parallel ranks agree on what they read (gloo on CPU, TP = 2): ranks that read different files for
one load (same size, different size) refuse it on both with nothing changed; the ranks' digest is the
unsharded one; replacements and loads from tensors agree likewise and serve the unsharded outputs."""

from __future__ import annotations

import os
import shutil
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.parallel import TensorParallel

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": {"r": 8, "lora_alpha": 16, "target_modules": ALL, "seed": 31},
    "b": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 32},
}
# One element of rank 0's shard of this B (rows 0..31 of 64) differs in "a_ulp": rank 1 reads only its own
# shard, so without the whole-tensor digest it could not tell.
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
NAMES = ["x", None, "x"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load(root: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "model").eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (len(NAMES), 3), generator=torch.Generator().manual_seed(5))


def _manager(model: torch.nn.Module, tp: TensorParallel | None = None) -> LoRAManager:
    return LoRAManager(model, max_loras_per_batch=2, max_lora_rank=8, lora_target_modules=ALL, tp=tp)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, adapters a, b and a_ulp (a with one element one ulp up), and per adapter the
    unsharded manager's digest and logits."""
    root = tmp_path_factory.mktemp("tp_identity")
    make_tiny_llama(root / "model", heads=4, kv_heads=1, layers=2)
    for name, spec in ADAPTERS.items():
        make_peft_adapter(root / "model", root / name, **spec)
    shutil.copytree(root / "a", root / "a_ulp")
    tensors = load_file(root / "a" / "adapter_model.safetensors")
    tensors[KEY][1, 2] = torch.nextafter(tensors[KEY][1, 2], torch.tensor(float("inf")))
    save_file(tensors, root / "a_ulp" / "adapter_model.safetensors")
    want: dict[str, Any] = {}
    for name in ("a", "b"):
        model = _load(root)
        mgr = _manager(model)
        mgr.load("x", root / name)
        with torch.inference_mode(), mgr.batch(NAMES):
            want[name] = (mgr.identity("x").digest, model(_ids()).logits)
    torch.save(want, root / "want.pt")
    return root


def _same_on_every_rank(value: Any, tp: TensorParallel) -> None:
    found: list[Any] = [None] * tp.size
    dist.all_gather_object(found, value, group=tp.group)
    assert all(v == found[0] for v in found), found


def _refused(mgr: LoRAManager, tp: TensorParallel, paths: dict[int, Path], replace: bool) -> str:
    before = (mgr.registry.stats(), mgr.stats()["identities"], sorted(mgr.host))
    with pytest.raises(AdapterLoadError, match="read different adapters") as refused:
        mgr.load("x", paths[tp.rank], replace=replace)
    assert (mgr.registry.stats(), mgr.stats()["identities"], sorted(mgr.host)) == before
    mgr.registry.audit()
    return str(refused.value)


def _check(root: Path, tp: TensorParallel) -> None:
    from lora_pin.parallel_fixtures import shard_llama

    want = torch.load(root / "want.pt")
    model = shard_llama(_load(root), tp)
    mgr = _manager(model, tp)

    def serves(name: str) -> None:
        with torch.inference_mode(), mgr.batch(NAMES):
            got = model(_ids()).logits
        torch.testing.assert_close(got, want[name][1], rtol=1e-4, atol=1e-5)

    # Same size, one element apart (in rank 0's shard only), then different sizes.
    message = _refused(mgr, tp, {0: root / "a", 1: root / "a_ulp"}, replace=False)
    assert "rank(s) [0]" in message and "rank(s) [1]" in message and want["a"][0] in message
    _refused(mgr, tp, {0: root / "a", 1: root / "b"}, replace=False)
    assert "x" not in mgr.registry
    # The same files: one digest, the unsharded one, on every rank.
    mgr.load("x", root / "a")
    identity = mgr.identity("x")
    _same_on_every_rank((identity.id, identity.digest, identity.generation), tp)
    assert (identity.digest, identity.generation) == (want["a"][0], 1)
    serves("a")
    # Replacement: refused when the ranks read different files, agreed otherwise.
    _refused(mgr, tp, {0: root / "b", 1: root / "a_ulp"}, replace=True)
    assert mgr.identity("x") == identity
    serves("a")
    mgr.load("x", root / "b", replace=True)
    replaced = mgr.identity("x")
    assert (replaced.id, replaced.digest, replaced.generation) == (identity.id, want["b"][0], 2)
    serves("b")
    # From tensors: every rank hands over the whole tensors and keeps its part.
    config = (root / "a" / "adapter_config.json").read_text()
    import json

    tensors = load_file(root / "a" / "adapter_model.safetensors")
    mgr.load_tensors("x", tensors, json.loads(config), replace=True)
    assert (mgr.identity("x").digest, mgr.identity("x").generation) == (want["a"][0], 3)
    serves("a")
    # The registry counts the whole adapter's bytes, alike on both ranks (each holds half of them).
    _same_on_every_rank(mgr.registry.stats(), tp)
    assert mgr.registry.stats()["host"]["bytes"] > mgr.residency.host_bytes
    assert mgr.stats()["tp_collective_calls"]["agree_identity"] >= 6
    mgr.detach()


def _worker(rank: int, world: int, root_text: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    try:
        _check(Path(root_text), TensorParallel(rank, world))
    finally:
        dist.destroy_process_group()


def test_tp_ranks_agree_on_the_whole_adapters_identity(root: Path) -> None:
    mp.spawn(_worker, args=(2, str(root), _free_port()), nprocs=2, join=True)
