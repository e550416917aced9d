"""Fully sharded tensor-parallel layers on the CPU's prepared per-step path, two gloo processes.

Fused qkv (one kv head, replicated), row-parallel o, fused gate_up and row-parallel down, and the whole
sharded Llama,
in fp32 and bf16, prefill and decode, mixed adapters and base rows: each process's outputs equal PEFT's
forward of the same modules. The pool's rank is 8, so each process holds a chunk of 4 rows of every
slot's rank in the column layers: adapters "b" (rank 3) and "c" (rank 2) lie wholly in process 0's chunk
and process 1 holds none of them. A step whose only adapter is "b" must still complete on both (process
1's shrink is zeros, but its all-gather is the one process 0 waits in): decided from the group's full
ranks, never from a chunk's (the gloo timeout turns a deadlock into a failure, not a hang).

The prepared path is checked by what the dispatcher runs: after a step's first call, a layer's call runs
its shrink and expand by the plans the CPU backend made then, never a ``lora_pin`` op (which would check
and plan in full); a layer whose group no row uses runs no collective, on both processes alike.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from lora_pin import LoRAManager
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.parallel import ParallelLayout, TensorParallel, qkv_slices

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": {"r": 8, "lora_alpha": 16, "target_modules": ALL, "seed": 1},
    "b": {"r": 3, "lora_alpha": 6, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 2},
    "c": {"r": 2, "lora_alpha": 8, "target_modules": ["o_proj", "gate_proj", "up_proj"], "seed": 3},
}
MIXED: list[str | None] = ["a", None, "b", "c", None, "a"]
# Only adapters whose rank lies wholly in process 0's chunk, beside base rows.
SMALL: list[str | None] = ["b", None, "b"]
STEPS = {
    "mixed-prefill": (MIXED, [2, 1, 3, 1, 2, 1]),
    "mixed-decode": (MIXED, [1] * 6),
    "small-prefill": (SMALL, [3, 2, 4]),
    "small-decode": (SMALL, [1] * 3),
}
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
TIMEOUT = datetime.timedelta(seconds=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _token_names(names: list[str | None], counts: list[int]) -> list[str | None]:
    return [n for n, c in zip(names, counts, strict=True) for _ in range(c)]


def _inputs(step: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    counts = STEPS[step][1]
    generator = torch.Generator().manual_seed(len(step))
    tokens = sum(counts)
    return (
        torch.randn(tokens, 64, generator=generator).to(dtype),
        torch.randn(tokens, 128, generator=generator).to(dtype),
    )


def _model_ids(step: str) -> torch.Tensor:
    names, counts = STEPS[step]
    return torch.randint(0, 128, (len(names), max(counts)), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (4 heads, 1 kv head), the adapters, and PEFT's outputs for every step and dtype:
    layer 0's modules on the step's inputs and the whole model's logits, computed here (the processes
    only load them)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tp_prepared")
    make_tiny_llama(root / "model", heads=4, kv_heads=1, layers=2)
    for name, spec in ADAPTERS.items():
        make_peft_adapter(root / "model", root / name, **spec)
    references: dict[str, torch.Tensor] = {}
    for label, dtype in DTYPES.items():
        base = AutoModelForCausalLM.from_pretrained(root / "model", dtype=dtype).eval()
        peft = PeftModel.from_pretrained(base, root / "a", adapter_name="a")
        for n in ("b", "c"):
            peft.load_adapter(root / n, adapter_name=n)
        layer = peft.base_model.model.model.layers[0]
        with torch.inference_mode():
            for step, (names, counts) in STEPS.items():
                x, x_down = _inputs(step, dtype)
                per_token = [n or "__base__" for n in _token_names(names, counts)]
                for module in MODULES:
                    owner = layer.mlp if module in ("gate_proj", "up_proj", "down_proj") else layer.self_attn
                    got = getattr(owner, module)(
                        x_down if module == "down_proj" else x, adapter_names=per_token
                    )
                    references[f"{label}/{step}/{module}"] = got.float()
                ids = _model_ids(step)[:, : max(counts)]
                logits = peft(ids, adapter_names=[n or "__base__" for n in names]).logits
                references[f"{label}/{step}/logits"] = logits.float()
    torch.save(references, root / "references.pt")
    return root


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


class _LoraOps(TorchDispatchMode):
    """Records every ``lora_pin`` op the dispatcher runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("lora_pin"):
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def _worker(rank: int, world: int, root_text: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    torch.set_num_threads(1)
    try:
        root = Path(root_text)
        references = torch.load(root / "references.pt")
        tp = TensorParallel(rank, world, fully_sharded=True)
        for label, dtype in DTYPES.items():
            _check_fused_layers(root, tp, label, dtype, references)
            _check_model(root, tp, label, dtype, references)
    finally:
        dist.destroy_process_group()


def _fused_model(root: Path, tp: TensorParallel, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny Llama's linears as a framework cuts them: fused qkv (q by rank, the one kv head
    replicated), row-parallel o, fused gate_up, row-parallel down."""
    from lora_pin.parallel_fixtures import ColumnParallelLinear, RowParallelLinear

    weights = load_file(root / "model" / "model.safetensors")
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for i in range(2):
        w = {
            k.rsplit(".", 2)[-2]: v.to(dtype)
            for k, v in weights.items()
            if k.startswith(f"model.layers.{i}.")
        }
        layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        qkv = qkv_slices(tp, q_out=64, kv_out=16, num_kv_heads=1)
        fused = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])
        attn.qkv_proj = ColumnParallelLinear(fused, ParallelLayout("column", tp, 64, qkv))
        attn.o_proj = RowParallelLinear(w["o_proj"], tp)
        mlp.gate_up_proj = ColumnParallelLinear(
            torch.cat([w["gate_proj"], w["up_proj"]]), ParallelLayout.column(tp, 64, 128, 128)
        )
        mlp.down_proj = RowParallelLinear(w["down_proj"], tp)
        layer.self_attn, layer.mlp = attn, mlp
        model.model.layers.append(layer)
    return model


def _run(
    layer: torch.nn.Module, x: torch.Tensor, x_o: torch.Tensor, x_down: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return (
        layer.self_attn.qkv_proj(x),
        layer.self_attn.o_proj(x_o),
        layer.mlp.gate_up_proj(x),
        layer.mlp.down_proj(x_down),
    )


def _collectives(mgr: LoRAManager) -> int:
    return sum(mgr.stats()["tp_collective_calls"].values())


def _check_fused_layers(
    root: Path, tp: TensorParallel, label: str, dtype: torch.dtype, references: dict[str, torch.Tensor]
) -> None:
    model = _fused_model(root, tp, dtype)
    mgr = LoRAManager(
        model,
        [f"{n}={root / n}" for n in ADAPTERS],
        max_loras_per_batch=3,
        max_lora_rank=8,
        fused_modules={
            "qkv_proj": [("q_proj", 64 // tp.size), ("k_proj", 16), ("v_proj", 16)],
            "gate_up_proj": [("gate_proj", 128 // tp.size), ("up_proj", 128 // tp.size)],
        },
        tp=tp,
    )
    layer = model.model.layers[0]
    width = 128 // tp.size
    q, k, _ = qkv_slices(tp, q_out=64, kv_out=16, num_kv_heads=1)
    for step_name, (names, counts) in STEPS.items():
        x, x_down = _inputs(step_name, dtype)
        x_down_local = x_down[:, tp.rank * width : (tp.rank + 1) * width].contiguous()
        half = 64 // tp.size
        x_o_local = x[:, tp.rank * half : (tp.rank + 1) * half].contiguous()

        step = mgr.prepare_step(names, counts)
        try:
            assert step.admitted == tuple(range(len(names)))
            with torch.inference_mode():
                _run(layer, x, x_o_local, x_down_local)  # the step's first calls prepare
                before = _collectives(mgr)
                with _LoraOps() as ops:
                    qkv, o, gate_up, down = _run(layer, x, x_o_local, x_down_local)
                collectives = _collectives(mgr) - before
        finally:
            mgr.finish(step)
        where = f"{label} {step_name} rank {tp.rank}"
        want = {m: references[f"{label}/{step_name}/{m}"] for m in MODULES}
        want_qkv = torch.cat(
            [
                want["q_proj"][:, slice(*q.rows)],
                want["k_proj"][:, slice(*k.rows)],
                want["v_proj"][:, slice(*k.rows)],
            ],
            dim=1,
        )
        rows = slice(tp.rank * width, (tp.rank + 1) * width)
        want_gate_up = torch.cat([want["gate_proj"][:, rows], want["up_proj"][:, rows]], dim=1)
        for what, got, expected in (
            ("qkv", qkv, want_qkv),
            ("o", o, want["o_proj"]),
            ("gate_up", gate_up, want_gate_up),
            ("down", down, want["down_proj"]),
        ):
            assert got.dtype == dtype
            assert _relative(got, expected) < TOLERANCE[label], (where, what, _relative(got, expected))
        # Every layer by the plans of the step's first calls: no op checks anything again. A group no
        # row uses ("b" has no o, gate or up) runs no collective; process 1's chunk of the qkv rank
        # holds none of "b"'s rank 3, but its all-gather still runs, as process 0 waits in it.
        assert ops.calls == [], (where, ops.calls)
        assert collectives == (4 if names is MIXED else 2), (where, collectives)
    mgr.detach()


def _check_model(
    root: Path, tp: TensorParallel, label: str, dtype: torch.dtype, references: dict[str, torch.Tensor]
) -> None:
    """The whole sharded Llama (separate q, k, v, o, gate, up, down) against PEFT's logits."""
    from transformers import AutoModelForCausalLM

    from lora_pin.parallel_fixtures import shard_llama

    model = shard_llama(AutoModelForCausalLM.from_pretrained(root / "model", dtype=dtype).eval(), tp)
    mgr = LoRAManager(
        model, [f"{n}={root / n}" for n in ADAPTERS], max_loras_per_batch=3, max_lora_rank=8, tp=tp
    )
    for step_name, (names, counts) in STEPS.items():
        key = f"{label}/{step_name}/logits"
        ids = _model_ids(step_name)[:, : max(counts)]
        with torch.inference_mode():
            base = model(ids).logits.clone()
            with mgr.batch(names):
                got = model(ids).logits
        where = f"{label} {step_name} rank {tp.rank}"
        assert _relative(got, references[key]) < TOLERANCE[label], (where, _relative(got, references[key]))
        for i, name in enumerate(names):
            if name is None:
                assert torch.equal(got[i], base[i]), (where, i)
    mgr.detach()


def test_fully_sharded_layers_on_the_prepared_path_match_peft_at_tp_2(root: Path) -> None:
    mp.spawn(_worker, args=(2, str(root), _free_port()), nprocs=2, join=True)
