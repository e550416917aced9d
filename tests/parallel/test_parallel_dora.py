"""DoRA adapters under tensor parallelism (gloo on CPU, TP = 2), against PEFT's single-adapter forward.

A tiny Llama cut Megatron-style (:func:`lora_pin.parallel_fixtures.shard_llama`): q/k/v and gate/up are
column-parallel (each rank's factors are its own output features'), o and down row-parallel (each rank
holds half of every row of ``W + s B A``, so the norms are all-reduced once the ranks agree on the read).
Mixed batches of DoRA, LoRA and base rows, fp32 and bf16, prefill and a decode step; every adapter row
against PEFT with that adapter alone (PEFT refuses ``adapter_names`` with DoRA), every base row bit for bit
against the sharded base model. Then, with one slot and a small host tier, the DoRA adapters are evicted
and read again, by blocking and by background loading, and loaded at run time. Two processes are spawned
once and run every check (their start-up is most of the cost).
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.parallel import TensorParallel

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES: list[str | None] = ["dora", None, "lora", "dora_rs", "dora", None]
# Rows compared with PEFT, by dtype: over sums of 64 to 128 products and an all-reduce.
TOLERANCE = {torch.float32: (2e-4, 2e-5), torch.bfloat16: (6e-2, 6e-2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load(root: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "model").eval()


def _save_dora(base: torch.nn.Module, out_dir: Path, seed: int, **config: Any) -> Path:
    """A PEFT DoRA adapter over a copy of ``base``: seeded random A and B (PEFT starts B at zero) and
    magnitudes moved off their initial ``||W||``, so every factor is far from 1."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(lora_dropout=0.0, use_dora=True, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            elif "lora_magnitude_vector" in name:
                param.mul_(1 + 0.3 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return (
        torch.randint(0, 128, (len(NAMES), 5), generator=generator),
        torch.randint(0, 128, (len(NAMES), 1), generator=generator),
    )


def _run(model: torch.nn.Module, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill and one decode step of the batch's ``rows`` (all: None): their logits."""
    prompt, step = (t if rows is None else t[rows] for t in _inputs())
    first = model(input_ids=prompt, use_cache=True)
    mask = torch.ones(prompt.shape[0], prompt.shape[1] + 1, dtype=torch.long)
    second = model(input_ids=step, cache=first.cache, attention_mask=mask)
    return first.logits, second.logits


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (4 heads, 1 kv head, replicated over the ranks), the adapters (``dora``: every
    target, a rank pattern; ``dora_rs``: rsLoRA, an alpha pattern, one column and two row layers;
    ``lora``: plain) and PEFT's prefill and decode logits of the batch with each adapter alone, computed
    here (PEFT stays out of the ranks' start-up)."""
    from peft import PeftModel

    root = tmp_path_factory.mktemp("tp_dora")
    make_tiny_llama(root / "model", heads=4, kv_heads=1, layers=2)
    base = _load(root)
    _save_dora(base, root / "dora", 1, r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"down_proj": 4})
    _save_dora(
        base,
        root / "dora_rs",
        2,
        r=4,
        lora_alpha=4,
        target_modules=["v_proj", "o_proj", "down_proj"],
        use_rslora=True,
        alpha_pattern={"o_proj": 12},
    )
    make_peft_adapter(root / "model", root / "lora", r=4, lora_alpha=8, target_modules=ALL, seed=3)
    want: dict[str, dict[str, Any]] = {"float32": {}, "bfloat16": {}}
    with torch.inference_mode():
        for name in ("dora", "dora_rs", "lora"):
            peft = PeftModel.from_pretrained(copy.deepcopy(base), root / name).eval()
            want["float32"][name] = _run(peft)
            want["bfloat16"][name] = _run(peft.to(torch.bfloat16))
    torch.save(want, root / "peft.pt")
    return root


def _check_rows(
    got: tuple[torch.Tensor, torch.Tensor],
    want: dict[str, tuple[torch.Tensor, torch.Tensor]],
    base: tuple[torch.Tensor, torch.Tensor],
    names: list[str | None],
    rows: list[int],
) -> None:
    """Row ``i`` of ``got`` (prefill and decode) is batch row ``rows[i]``, served with ``names[i]``;
    ``base`` is the base model's output of the same batch."""
    rtol, atol = TOLERANCE[got[0].dtype]
    for phase in (0, 1):
        for i, (row, name) in enumerate(zip(rows, names, strict=True)):
            if name is None:
                assert torch.equal(got[phase][i], base[phase][i]), (phase, row)
                continue
            torch.testing.assert_close(
                got[phase][i].float(),
                want[name][phase][row].float(),
                rtol=rtol,
                atol=atol,
                msg=f"{phase} {row} {name}",
            )


def _gathered(value: Any, tp: TensorParallel) -> list[Any]:
    found: list[Any] = [None] * tp.size
    dist.all_gather_object(found, value, group=tp.group)
    return found


def _worker(rank: int, world: int, root_text: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        root = Path(root_text)
        tp = TensorParallel(rank, world)
        want = torch.load(root / "peft.pt")
        for dtype in (torch.float32, torch.bfloat16):
            _check_mixed_batch(root, tp, want[str(dtype).removeprefix("torch.")], dtype)
        for loading in ("blocking", "background"):
            _check_eviction_and_reload(root, tp, want["float32"], loading)
        _check_fully_sharded_refused(root, rank, world)
    finally:
        dist.destroy_process_group()


def _check_mixed_batch(root: Path, tp: TensorParallel, want: dict[str, Any], dtype: torch.dtype) -> None:
    """DoRA, LoRA and base rows in one batch: each adapter row is PEFT's, each base row the sharded base
    model's bit for bit; a row layer's factors are alike on every rank, a column layer's its own rows'."""
    from lora_pin.parallel_fixtures import shard_llama

    model = shard_llama(_load(root).to(dtype), tp)
    with torch.inference_mode():
        base = _run(model)
    mgr = LoRAManager(
        model, [f"{n}={root / n}" for n in ("dora", "dora_rs", "lora")], max_loras_per_batch=3, tp=tp
    )
    with torch.inference_mode(), mgr.batch(NAMES):
        got = _run(model)
    _check_rows(got, want, base, NAMES, list(range(len(NAMES))))
    assert mgr.stats()["tp_collective_calls"]["dora_norms"] == 2  # one per DoRA adapter read
    down = mgr.host["dora"].modules["model.layers.0.mlp.down_proj"]
    q = mgr.host["dora"].modules["model.layers.0.self_attn.q_proj"]
    assert down.factor is not None and q.factor is not None and q.factor.shape == (64 // tp.size,)
    downs, qs = _gathered(down.factor, tp), _gathered(q.factor, tp)
    assert all(torch.equal(f, downs[0]) for f in downs)
    assert not torch.equal(qs[0], qs[1])
    identities = _gathered(mgr.identity("dora").digest, tp)
    assert len(set(identities)) == 1
    mgr.detach()


def _check_eviction_and_reload(root: Path, tp: TensorParallel, want: dict[str, Any], loading: str) -> None:
    """One slot and one adapter in host memory: each step evicts the last one from its slot and from host
    memory, so ``dora`` is read again (its norms all-reduced again) before it is served again; ``dora_rs``
    and ``lora`` are loaded at run time. Every row is still PEFT's."""
    from lora_pin.parallel_fixtures import shard_llama

    model = shard_llama(_load(root), tp)
    mgr = LoRAManager(
        model,
        [f"dora={root / 'dora'}"],
        max_loras_per_batch=1,
        max_loaded_loras=1,
        max_lora_rank=8,
        lora_target_modules=ALL,
        loading=loading,
        tp=tp,
    )
    mgr.load("dora_rs", root / "dora_rs")
    mgr.load("lora", root / "lora")
    for name, row in (("dora", 0), ("dora_rs", 3), ("lora", 2), ("dora", 4), ("dora_rs", 0)):
        with torch.inference_mode():
            base = _run(model, [row, 1])  # the same batch shapes, so base rows compare bit for bit
            with mgr.batch([name, None]):
                got = _run(model, [row, 1])
        _check_rows(got, want, base, [name, None], [row, 1])
    evictions = mgr.stats()["evictions_by_adapter"]
    assert evictions.get("dora/host", 0) >= 2, evictions  # read again after each
    states = _gathered(mgr.registry.placement()["adapters"], tp)
    assert states[0] == states[1]
    mgr.detach()


def _check_fully_sharded_refused(root: Path, rank: int, world: int) -> None:
    """Fully sharded tensor parallelism cuts A's rank rows: DoRA is refused by name, on every rank, and a
    plain adapter still loads."""
    from lora_pin.parallel_fixtures import shard_llama

    tp = TensorParallel(rank, world, fully_sharded=True)
    model = shard_llama(_load(root), tp)
    mgr = LoRAManager(model, [f"lora={root / 'lora'}"], max_loras_per_batch=2, max_lora_rank=8, tp=tp)
    with pytest.raises(AdapterLoadError, match="fully sharded"):
        mgr.load("dora", root / "dora")
    assert "dora" not in mgr.registry
    mgr.detach()


def test_dora_at_tp_2_equals_peft_through_eviction_and_both_loadings(root: Path) -> None:
    mp.spawn(_worker, args=(2, str(root), _free_port()), nprocs=2, join=True)
