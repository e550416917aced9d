"""Tensor parallelism over gloo on CPU: sharded outputs equal one process's and PEFT's; ranks agree.

The multi-process test spawns four processes once and runs every check of both modes at TP = 4 and at
TP = 2 (two groups of two side by side) in them: the processes' start-up (torch and transformers imports)
is most of the cost, and CI's budget is small. The tiny Llama
has one kv head, fewer than the ranks, so k and v are replicated.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError, SpecError
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.parallel import ColumnSlice, ParallelLayout, TensorParallel, qkv_slices

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Different ranks (3 and 2 below TP = 4) and targets; "c" has neither q nor k nor v.
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": {"r": 8, "lora_alpha": 16, "target_modules": ALL, "seed": 1},
    "b": {"r": 3, "lora_alpha": 6, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 2},
    "c": {"r": 2, "lora_alpha": 8, "target_modules": ["o_proj", "gate_proj", "up_proj"], "seed": 3},
}
NAMES = ["a", None, "b", "c", None, "a"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with 4 heads and 1 kv head, the adapters above, and "bad": an adapter whose only NaN
    lies in the q_proj B rows of the last rank at TP = 2 and TP = 4 (rows 48..63 of 64)."""
    root = tmp_path_factory.mktemp("tp")
    make_tiny_llama(root / "model", heads=4, kv_heads=1, layers=2)
    for name, spec in ADAPTERS.items():
        make_peft_adapter(root / "model", root / name, **spec)
    bad = make_peft_adapter(root / "model", root / "bad", r=4, lora_alpha=8, target_modules=ALL, seed=4)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    tensors[key][60, 1] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors")
    # transformers' own tp_plan cuts every kv head's rows over the ranks: 4 kv heads for TP = 4.
    make_tiny_llama(root / "hf", heads=4, kv_heads=4, layers=2)
    make_peft_adapter(root / "hf", root / "h", r=4, lora_alpha=8, target_modules=ALL, seed=6)
    _save_references(root)
    return root


def _load(root: Path, model: str = "model", **kwargs: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / model, **kwargs).eval()


def _inputs() -> torch.Tensor:
    return torch.randint(0, 128, (len(NAMES), 7), generator=torch.Generator().manual_seed(5))


def _save_references(root: Path) -> None:
    """PEFT's and unsharded lora_pin's logits for the mixed batch, computed once in this process (the
    ranks only load them: PEFT stays out of their start-up)."""
    from peft import PeftModel

    ids = _inputs()
    with torch.inference_mode():
        peft = PeftModel.from_pretrained(_load(root), root / "a", adapter_name="a")
        for n in ("b", "c"):
            peft.load_adapter(root / n, adapter_name=n)
        want_peft = peft(ids, adapter_names=[n or "__base__" for n in NAMES]).logits
        single = _load(root)
        mgr = LoRAManager(
            single, [f"{n}={root / n}" for n in ADAPTERS], max_loras_per_batch=3, max_lora_rank=8
        )
        with mgr.batch(NAMES):
            want_single = single(ids).logits
        hf = PeftModel.from_pretrained(_load(root, "hf"), root / "h", adapter_name="h")
        want_hf = hf(ids[:3], adapter_names=["h", "__base__", "h"]).logits
    torch.save({"peft": want_peft, "single": want_single, "hf": want_hf}, root / "references.pt")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _worker(rank: int, world: int, root_text: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        _check_transformers_tp(Path(root_text))
        # TP = 4 over the whole group, then TP = 2 twice side by side (ranks 0-1 and 2-3, as with data
        # parallelism over tensor-parallel groups): a rank's shard is its rank in its group, not the
        # global one.
        _checks(rank, world, None, Path(root_text))
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _checks(rank % 2, 2, pairs[rank // 2], Path(root_text))
    finally:
        dist.destroy_process_group()


def _check_transformers_tp(root: Path) -> None:
    """A model cut by transformers' own ``tp_plan="auto"`` (DTensor weights): the manager finds the cut
    linears without being told and serves PEFT's outputs; base rows are the cut base model's."""
    from transformers.distributed import DistributedConfig

    model = _load(root, "hf", distributed_config=DistributedConfig(tp_plan="auto"))
    ids = _inputs()[:3]
    with torch.inference_mode():
        base = model(ids).logits.clone()
    with pytest.raises(SpecError, match="'lm_head' is cut by tensor parallelism"):
        LoRAManager(model, max_lora_rank=4, lora_target_modules=["q_proj", "lm_head"])
    mgr = LoRAManager(model, [f"h={root / 'h'}"], max_loras_per_batch=2)
    assert mgr.tp is not None and mgr.tp.size == dist.get_world_size()
    with torch.inference_mode(), mgr.batch(["h", None, "h"]):
        got = model(ids).logits
    want = torch.load(root / "references.pt")["hf"]
    assert _relative(got, want) < 1e-5, _relative(got, want)
    assert torch.equal(got[1], base[1])
    q = mgr.host["h"].modules["model.layers.0.self_attn.q_proj"]
    assert q.b.shape == (64 // mgr.tp.size, 4)
    mgr.detach()
    # Fully sharded over the same DTensor layers, asked for explicitly.
    tp = TensorParallel(dist.get_rank(), dist.get_world_size(), fully_sharded=True)
    mgr = LoRAManager(model, [f"h={root / 'h'}"], max_loras_per_batch=2, max_lora_rank=4, tp=tp)
    with torch.inference_mode(), mgr.batch(["h", None, "h"]):
        got = model(ids).logits
    assert _relative(got, want) < 1e-5, _relative(got, want)
    assert torch.equal(got[1], base[1])
    assert mgr.stats()["tp_collective_calls"]["all_gather"] > 0
    mgr.detach()


def _checks(rank: int, size: int, group: Any, root: Path) -> None:
    from lora_pin.parallel_fixtures import shard_llama

    ids = _inputs()
    lora_paths = [f"{n}={root / n}" for n in ADAPTERS]
    references = torch.load(root / "references.pt")
    want_peft, want_single = references["peft"], references["single"]
    for fully in (False, True):
        tp = TensorParallel(rank, size, group, fully_sharded=fully)
        model = shard_llama(_load(root), tp)
        with torch.inference_mode():
            base = model(ids).logits.clone()
        mgr = LoRAManager(model, lora_paths, max_loras_per_batch=3, max_lora_rank=8, tp=tp)
        with torch.inference_mode(), mgr.batch(NAMES):
            got = model(ids).logits
        assert _relative(got, want_peft) < 1e-5, (fully, _relative(got, want_peft))
        assert _relative(got, want_single) < 1e-5, (fully, _relative(got, want_single))
        for i, name in enumerate(NAMES):
            if name is None:
                assert torch.equal(got[i], base[i]), (fully, i)
        _check_host_shards(mgr, root, tp)
        _check_runtime_ops(mgr, model, ids, root, tp)
        mgr.detach()
        _check_reread_failing_on_one_rank(model, root, tp)
        _check_fused_layers(root, tp)
    _check_pages(rank, size, group, root)


def _check_pages(rank: int, size: int, group: Any, root: Path) -> None:
    """A paged pool holds each rank's shard of every group in its pages: the same logits as PEFT, base
    rows untouched; a fully sharded pool, whose rank is cut, is refused by name on every rank."""
    from lora_pin.errors import PoolError
    from lora_pin.parallel_fixtures import shard_llama

    ids = _inputs()
    lora_paths = [f"{n}={root / n}" for n in ADAPTERS]
    want_peft = torch.load(root / "references.pt")["peft"]
    tp = TensorParallel(rank, size, group)
    model = shard_llama(_load(root), tp)
    with torch.inference_mode():
        base = model(ids).logits.clone()
    mgr = LoRAManager(model, lora_paths, max_lora_rank=8, tp=tp, page_rank=4, max_lora_memory="16MiB")
    assert mgr.pool.page_rank == 4 and mgr.registry.max_lora_memory == mgr.pool.pages
    with torch.inference_mode(), mgr.batch(NAMES):
        got = model(ids).logits
    assert _relative(got, want_peft) < 1e-5, _relative(got, want_peft)
    for i, name in enumerate(NAMES):
        if name is None:
            assert torch.equal(got[i], base[i]), i
    # "a" (rank 8) takes two pages of 4 on every rank; "b" (3) and "c" (2) one each.
    assert mgr.stats()["device"]["pages"] == 4
    mgr.detach()
    fully = TensorParallel(rank, size, group, fully_sharded=True)
    with pytest.raises(
        PoolError, match=r"cannot be paged: its adapters' rank is cut over the tensor-parallel"
    ):
        LoRAManager(
            shard_llama(_load(root), fully), lora_paths, max_lora_rank=8, tp=fully, page_rank=4,
            max_lora_memory="16MiB",
        )  # fmt: skip


def _check_host_shards(mgr: LoRAManager, root: Path, tp: TensorParallel) -> None:
    """Each rank holds exactly its slices of A and B, read from the file."""
    stored = load_file(root / "a" / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0."
    host = mgr.host["a"]
    q = host.modules["model.layers.0.self_attn.q_proj"]
    a, b = (
        stored[prefix + "self_attn.q_proj.lora_A.weight"],
        stored[prefix + "self_attn.q_proj.lora_B.weight"],
    )
    rows = 64 // tp.size
    assert torch.equal(q.b[:, :8], b[tp.rank * rows : (tp.rank + 1) * rows])
    chunk = -(-8 // tp.size)
    if tp.fully_sharded:
        assert torch.equal(q.a, a[tp.rank * chunk : (tp.rank + 1) * chunk])
    else:
        assert torch.equal(q.a, a)
    down = host.modules["model.layers.0.mlp.down_proj"]
    a, b = stored[prefix + "mlp.down_proj.lora_A.weight"], stored[prefix + "mlp.down_proj.lora_B.weight"]
    cols = 128 // tp.size
    assert torch.equal(down.a, a[:, tp.rank * cols : (tp.rank + 1) * cols])
    out = 64 // tp.size
    assert torch.equal(down.b, b[tp.rank * out : (tp.rank + 1) * out] if tp.fully_sharded else b)


def _fused_model(root: Path, tp: TensorParallel) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny Llama's linears as a framework cuts them: fused qkv (q by rank, the one kv head replicated),
    fused gate_up, row-parallel o and down; returns it and the unsharded weights."""
    from lora_pin.parallel_fixtures import ColumnParallelLinear, RowParallelLinear

    weights = load_file(root / "model" / "model.safetensors")
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for i in range(2):
        w = {k.rsplit(".", 2)[-2]: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
        layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        qkv = qkv_slices(tp, q_out=64, kv_out=16, num_kv_heads=1)
        fused = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])
        attn.qkv_proj = ColumnParallelLinear(fused, ParallelLayout("column", tp, 64, qkv))
        attn.o_proj = RowParallelLinear(w["o_proj"], tp)
        gate_up = ParallelLayout.column(tp, 64, 128, 128)
        mlp.gate_up_proj = ColumnParallelLinear(torch.cat([w["gate_proj"], w["up_proj"]]), gate_up)
        mlp.down_proj = RowParallelLinear(w["down_proj"], tp)
        layer.self_attn, layer.mlp = attn, mlp
        model.model.layers.append(layer)
    return model, weights


def _expected(
    root: Path, weights: dict[str, torch.Tensor], x: torch.Tensor, token_names: list[str | None], module: str
) -> torch.Tensor:
    """Layer 0's ``module`` output for every token, unsharded, in float64: the base product plus each
    token's adapter delta ``scaling * x Aᵀ Bᵀ`` read straight from the adapter files."""
    import json

    w = weights[f"model.layers.0.{module}.weight"].double()
    out = x.double() @ w.T
    for t, name in enumerate(token_names):
        if name is None:
            continue
        config = json.loads((root / name / "adapter_config.json").read_text())
        stored = load_file(root / name / "adapter_model.safetensors")
        key = f"base_model.model.model.layers.0.{module}"
        if f"{key}.lora_A.weight" in stored:
            a, b = stored[f"{key}.lora_A.weight"].double(), stored[f"{key}.lora_B.weight"].double()
            out[t] += config["lora_alpha"] / config["r"] * (b @ (a @ x[t].double()))
    return out


def _check_fused_layers(root: Path, tp: TensorParallel) -> None:
    """Fused qkv under GQA, fused gate_up and row-parallel down, on a packed step with base tokens: each
    rank's output is its part of the unsharded layers' (rel err < 1e-5)."""
    model, weights = _fused_model(root, tp)
    q_local, kv_local = 64 // tp.size, 16
    mgr = LoRAManager(
        model,
        [f"{n}={root / n}" for n in ADAPTERS],
        max_loras_per_batch=3,
        max_lora_rank=8,
        fused_modules={
            "qkv_proj": [("q_proj", q_local), ("k_proj", kv_local), ("v_proj", kv_local)],
            "gate_up_proj": [("gate_proj", 128 // tp.size), ("up_proj", 128 // tp.size)],
        },
        tp=tp,
    )
    counts = [2, 1, 3, 1, 2, 1]
    token_names = [n for n, c in zip(NAMES, counts, strict=True) for _ in range(c)]
    generator = torch.Generator().manual_seed(9)
    x, x_down = (
        torch.randn(len(token_names), 64, generator=generator),
        torch.randn(len(token_names), 128, generator=generator),
    )
    layer = model.model.layers[0]
    step = mgr.prepare_step(NAMES, counts)
    try:
        assert step.admitted == tuple(range(len(NAMES)))
        with torch.inference_mode():
            qkv = layer.self_attn.qkv_proj(x)
            gate_up = layer.mlp.gate_up_proj(x)
            width = 128 // tp.size
            down = layer.mlp.down_proj(x_down[:, tp.rank * width : (tp.rank + 1) * width].contiguous())
    finally:
        mgr.finish(step)
    q, k, _ = qkv_slices(tp, q_out=64, kv_out=16, num_kv_heads=1)
    want = {
        m: _expected(root, weights, x, token_names, m)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    }
    want_qkv = torch.cat(
        [
            want["self_attn.q_proj"][:, slice(*q.rows)],
            want["self_attn.k_proj"][:, slice(*k.rows)],
            want["self_attn.v_proj"][:, slice(*k.rows)],
        ],
        dim=1,
    )
    rows = slice(tp.rank * width, (tp.rank + 1) * width)
    want_gate_up = torch.cat([want["mlp.gate_proj"][:, rows], want["mlp.up_proj"][:, rows]], dim=1)
    want_down = _expected(root, weights, x_down, token_names, "mlp.down_proj")
    for got, expected in ((qkv, want_qkv), (gate_up, want_gate_up), (down, want_down)):
        assert _relative(got.double(), expected) < 1e-5, (tp, _relative(got.double(), expected))


def _check_reread_failing_on_one_rank(model: torch.nn.Module, root: Path, tp: TensorParallel) -> None:
    """An adapter evicted from host memory is read again by the step that needs it; when the last rank's
    shard of its file went bad meanwhile, the step fails on every rank (none waits in a collective) and
    nothing was acquired; once the file is good again the step runs."""
    import shutil

    folder = root / f"x-{tp.size}-{int(tp.fully_sharded)}-{dist.get_rank() - tp.rank}"
    weights = folder / "adapter_model.safetensors"
    if tp.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(root / "b", folder)
    dist.barrier(group=tp.group)
    mgr = LoRAManager(
        model,
        [f"x={folder}"],
        max_loras_per_batch=1,
        max_loaded_loras=1,
        max_lora_rank=8,
        lora_target_modules=ALL,
        tp=tp,
    )
    mgr.load("y", root / "c")  # the host tier holds one adapter: x goes back to disk only
    assert "x" not in mgr.host
    # Rank 0 alone reads and rewrites the file (the others may not read it while it is rewritten).
    good = load_file(weights) if tp.rank == 0 else {}
    if tp.rank == 0:
        bad = dict(good)
        bad["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] = good[
            "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
        ].clone()
        bad["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"][60, 0] = float("nan")
        save_file(bad, weights)
    dist.barrier(group=tp.group)
    ids = _inputs()[:1]
    with pytest.raises(AdapterLoadError), torch.inference_mode(), mgr.batch(["x"]):
        model(ids)
    assert "x" not in mgr.host and mgr.registry.in_flight("x") == 0
    dist.barrier(group=tp.group)
    if tp.rank == 0:
        save_file(good, weights)
    dist.barrier(group=tp.group)
    with torch.inference_mode(), mgr.batch(["x"]):
        model(ids)
    assert "x" in mgr.host
    mgr.detach()


def _gathered(value: Any, tp: TensorParallel) -> list[Any]:
    found: list[Any] = [None] * tp.size
    dist.all_gather_object(found, value, group=tp.group)
    return found


def _check_runtime_ops(
    mgr: LoRAManager, model: torch.nn.Module, ids: torch.Tensor, root: Path, tp: TensorParallel
) -> None:
    """Run-time load, pin, unpin and unload on every rank; one id for all ranks; a load that fails on
    one rank only fails on all, nothing changed."""
    ref = mgr.load("d", root / "b", pinned=True)
    ids_seen = _gathered(ref.lora_id, tp)
    assert len(set(ids_seen)) == 1, ids_seen
    mgr.unpin("d")
    mgr.pin("d")
    with torch.inference_mode(), mgr.batch(["d", None]):
        model(ids[:2])
    mgr.unpin("d")
    mgr.unload("d")
    _check_pin_refused_on_one_rank(mgr, tp)
    before = _state(mgr)
    with pytest.raises(AdapterLoadError) as caught:
        mgr.load("bad", root / "bad")
    if tp.rank == tp.size - 1:
        assert "NaN" in str(caught.value)
    else:
        assert f"failed on rank(s) [{tp.size - 1}]" in str(caught.value)
    assert _state(mgr) == before
    assert "bad" not in mgr.host
    states = _gathered(_state(mgr)[:2], tp)
    assert all(s == states[0] for s in states), states


def _check_pin_refused_on_one_rank(mgr: LoRAManager, tp: TensorParallel) -> None:
    """A pin that fails on one rank only (its registry made to hold one more pin) is undone where it
    succeeded: every rank raises CapacityError and keeps the pins it had."""
    from lora_pin.errors import CapacityError

    last = tp.rank == tp.size - 1
    if last:
        mgr.registry.pin("b")  # this rank alone: 3 slots, so a third pin leaves no slot here
    mgr.pin("a")
    with pytest.raises(CapacityError):
        mgr.pin("c")
    assert sorted(mgr.stats()["pinned_names"]) == (["a", "b"] if last else ["a"])
    if last:
        mgr.registry.unpin("b")
    mgr.unpin("a")
    assert mgr.stats()["pinned_names"] == []


def _state(mgr: LoRAManager) -> tuple[Any, ...]:
    """What a load may change: registrations (with ids), pins, the host tier's adapters and bytes."""
    registered = [(n, mgr.registry.lora_ref(n).lora_id) for n in (*ADAPTERS, "d", "bad") if n in mgr.registry]
    return registered, sorted(mgr.stats()["pinned_names"]), sorted(mgr.host), mgr.residency.host_bytes


def test_sharded_llama_at_tp_2_and_4_matches_one_process_and_peft(tp_root: Path) -> None:
    mp.spawn(_worker, args=(4, str(tp_root), _free_port()), nprocs=4, join=True)


def test_qkv_slices_replicate_kv_heads_when_fewer_than_ranks() -> None:
    # 8 ranks, 2 kv heads: ranks 0-3 hold kv head 0, ranks 4-7 kv head 1; q by rank.
    for rank in range(8):
        q, k, v = qkv_slices(TensorParallel(rank, 8), q_out=64, kv_out=16, num_kv_heads=2)
        assert q.rows == (rank * 8, rank * 8 + 8)
        assert k.rows == v.rows == ((rank // 4) * 8, (rank // 4) * 8 + 8)
    q, k, _ = qkv_slices(TensorParallel(1, 2), q_out=64, kv_out=16, num_kv_heads=4)
    assert (q.rows, k.rows) == ((32, 64), (8, 16))
    with pytest.raises(SpecError, match="replicated evenly"):
        qkv_slices(TensorParallel(0, 6), q_out=96, kv_out=16, num_kv_heads=4)


def test_tensor_parallel_refuses_bad_rank_or_size() -> None:
    with pytest.raises(SpecError, match="rank"):
        TensorParallel(2, 2)
    with pytest.raises(SpecError, match="size"):
        TensorParallel(0, 0)
    with pytest.raises(SpecError, match="divide"):
        ParallelLayout.row(TensorParallel(0, 3), 64, 64)
    with pytest.raises(SpecError, match="cannot be cut"):
        ParallelLayout.column(TensorParallel(0, 2), 64, ColumnSlice(63, 0, 2))


def test_slice_reads_take_rows_and_columns_of_the_stored_tensor(tmp_path: Path) -> None:
    from lora_pin.weights import open_adapter

    adapter = make_peft_adapter(
        make_tiny_llama(tmp_path / "m"), tmp_path / "x", r=5, lora_alpha=5, target_modules=["q_proj"]
    )
    stored = load_file(adapter / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with open_adapter("x", adapter) as file:
        for rows, cols in [((0, 5), (16, 48)), ((1, 3), (0, 64)), ((2, 2), (0, 64)), ((4, 5), (63, 64))]:
            out = torch.full((rows[1] - rows[0], cols[1] - cols[0]), 7.0)
            file.read_slice_into(name, out, rows, cols)
            assert torch.equal(out, stored[name][rows[0] : rows[1], cols[0] : cols[1]])
        half = torch.empty(5, 32, dtype=torch.float16)
        file.read_slice_into(name, half, (0, 5), (32, 64))
        assert torch.equal(half, stored[name][:, 32:].half())
        with pytest.raises(ValueError, match="slice"):
            file.read_slice_into(name, torch.empty(5, 65), (0, 5), (0, 65))


@pytest.mark.parametrize("fully", [False, True])
def test_a_rank_8_adapter_is_cut_over_16_ranks_with_zero_padding(tmp_path: Path, fully: bool) -> None:
    """At TP = 16 each rank's host module is its part of the file, fully sharded a chunk of one row of the
    rank (ranks 8 to 15: none, zero padding); put back together they are the adapter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_pin.parallel_fixtures import shard_llama

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=32,
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "m"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    adapter = make_peft_adapter(model_dir, tmp_path / "x", r=8, lora_alpha=16, target_modules=ALL)
    stored = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0."
    parts: dict[str, list[torch.Tensor]] = {"q_a": [], "q_b": [], "k_b": [], "down_a": [], "down_b": []}
    for rank in range(16):
        tp = TensorParallel(rank, 16, fully_sharded=fully)
        from lora_pin.model.attach import model_targets
        from lora_pin.parallel import shard_plan
        from lora_pin.weights import HostTier
        from lora_pin.weights.targets import ModuleSelection

        model = shard_llama(LlamaForCausalLM(config), tp)
        targets, module_of = model_targets(model, ModuleSelection.of(ALL))
        plan = shard_plan(model, targets, module_of, tp, max_rank=8)
        host = HostTier(targets, max_rank=8, dtype=torch.float32, shards=plan).read("x", adapter)
        q, k = (
            host.modules["model.layers.0.self_attn.q_proj"],
            host.modules["model.layers.0.self_attn.k_proj"],
        )
        down = host.modules["model.layers.0.mlp.down_proj"]
        assert q.a.shape == ((1, 64) if fully else (8, 64)) and q.b.shape == (4, 8)
        parts["q_a"].append(q.a)
        parts["q_b"].append(q.b)
        parts["k_b"].append(k.b)
        parts["down_a"].append(down.a)
        parts["down_b"].append(down.b)
    q_a = stored[key + "self_attn.q_proj.lora_A.weight"]
    if fully:
        padded = torch.cat([q_a, torch.zeros(8, 64)])
        assert torch.equal(torch.cat(parts["q_a"]), padded)
        assert torch.equal(torch.cat(parts["down_b"]), stored[key + "mlp.down_proj.lora_B.weight"])
    else:
        assert all(torch.equal(a, q_a) for a in parts["q_a"])
    assert torch.equal(torch.cat(parts["q_b"]), stored[key + "self_attn.q_proj.lora_B.weight"])
    # 2 kv heads of 4 rows over 16 ranks: ranks 0-7 hold head 0, ranks 8-15 head 1.
    k_b = stored[key + "self_attn.k_proj.lora_B.weight"]
    assert all(torch.equal(parts["k_b"][r], k_b[(r // 8) * 4 : (r // 8) * 4 + 4]) for r in range(16))
    assert torch.equal(torch.cat(parts["down_a"], dim=1), stored[key + "mlp.down_proj.lora_A.weight"])


def test_demo_tp_2_fully_sharded_matches_peft(tp_root: Path) -> None:
    """``lora-pin demo --tp 2`` on the tiny Llama: two gloo processes checked against PEFT, rank 0 reports."""
    import subprocess
    import sys

    import orjson

    items = [f"{n}={tp_root / n}" for n in ADAPTERS]
    argv = ["--model", str(tp_root / "model"), "--lora-paths", *items, "--max-loras-per-batch", "2"]
    argv += [
        "--tp",
        "2",
        "--fully-sharded",
        "--requests",
        "12",
        "--check-every",
        "2",
        "--json",
        "--no-progress",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "lora_pin", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = orjson.loads(out.stdout)
    assert report["ok"] and report["checked_steps"] >= 2 and report["max_relative_error"] <= 1e-4
    assert report["tp"] == {"size": 2, "fully_sharded": True}
    calls = report["stats"]["tp_collective_calls"]
    assert calls["all_gather"] > 0 and calls["all_reduce"] > 0 and calls["agree"] >= 1
    bad = subprocess.run(
        [sys.executable, "-m", "lora_pin", "demo", "--tp", "0"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "--tp must be at least 1 (got 0)" in bad.stderr


class _RowWithoutHalves(torch.nn.Module):
    """A row-parallel layer registered without saying how to run it in two halves."""

    def __init__(self, tp: TensorParallel) -> None:
        super().__init__()
        self.layout = ParallelLayout.row(tp, 128, 64)
        self.weight = torch.nn.Parameter(torch.zeros(64, 128 // tp.size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def test_bad_registrations_and_tp_settings_are_refused_before_any_collective(tp_root: Path) -> None:
    from lora_pin.parallel import register_parallel_linear
    from lora_pin.parallel_fixtures import shard_llama

    with pytest.raises(SpecError, match=r"not a torch\.nn\.Module subclass"):
        register_parallel_linear(int, layout=lambda m: m.layout)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="both partial and reduce"):
        register_parallel_linear(_RowWithoutHalves, layout=lambda m: m.layout, partial=lambda m, x: x)
    lora_paths = [f"a={tp_root / 'a'}"]
    # The layers are cut as rank 0 of 2; the manager is told rank 1.
    model = shard_llama(_load(tp_root), TensorParallel(0, 2))
    with pytest.raises(SpecError, match="cut as rank 0 of 2 but the manager's tp is rank 1 of 2"):
        LoRAManager(model, lora_paths, max_lora_rank=8, tp=TensorParallel(1, 2))
    with pytest.raises(SpecError, match="needs max_lora_rank"):
        LoRAManager(model, lora_paths, tp=TensorParallel(0, 2, fully_sharded=True))
    with pytest.raises(SpecError, match="adapter_dir is not available with tensor parallelism"):
        LoRAManager(model, lora_paths, max_lora_rank=8, tp=TensorParallel(0, 2), adapter_dir=tp_root)
    register_parallel_linear(_RowWithoutHalves, layout=lambda m: m.layout)
    model.model.layers[0].mlp.down_proj = _RowWithoutHalves(TensorParallel(0, 2))
    with pytest.raises(SpecError, match="register it with partial= and reduce="):
        LoRAManager(model, lora_paths, max_lora_rank=8, tp=TensorParallel(0, 2))
