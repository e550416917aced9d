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
from lora_pin.fixtures import (
    CANCEL_MODULE,
    ZERO_FEATURE,
    make_cancelling_dora,
    make_peft_adapter,
    make_tiny_llama,
    save_peft_adapter,
)
from lora_pin.parallel import TensorParallel

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES: list[str | None] = ["dora", None, "lora", "dora_rs", "dora", None]
# Rows compared with PEFT, by dtype: over sums of 64 to 128 products and an all-reduce.
TOLERANCE = {torch.float32: (2e-4, 2e-5), torch.bfloat16: (6e-2, 6e-2)}
# One layer's fp32 output against PEFT's module.
RTOL_LAYER = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load(root: Path, name: str = "model") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / name).eval()


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


# Tokens per request of NAMES in the fused layers' packed step.
COUNTS = [2, 1, 3, 1, 2, 1]


def _layer_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's inputs for the packed step: ``[T, 64]`` (q/k/v, gate/up) and ``[T, 128]`` (down)."""
    generator = torch.Generator().manual_seed(9)
    tokens = sum(COUNTS)
    return torch.randn(tokens, 64, generator=generator), torch.randn(tokens, 128, generator=generator)


def _save_qwen2(root: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny Qwen2 (q/k/v biases, made nonzero) saved for transformers' own ``tp_plan``, a DoRA adapter
    on it, and PEFT's logits of the batch with it alone and of the plain model."""
    from peft import PeftModel
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(root / "qwen2")
    save_peft_adapter(model, root / "qwen2_dora", 5, r=4, lora_alpha=8, target_modules=ALL, use_dora=True)
    with torch.inference_mode():
        peft = PeftModel.from_pretrained(copy.deepcopy(model), root / "qwen2_dora").eval()
        return {"qwen2_dora": _run(peft)}


def _save_cancelling(root: Path) -> torch.Tensor:
    """The tiny Llama edited by :func:`make_cancelling_dora` (saved as ``cancel_model``), its ``cancel``
    and ``zero`` adapters, and ``cancel``'s factors of layer 0's ``down_proj`` in float64."""
    from safetensors.torch import load_file

    base = _load(root)
    paths = make_cancelling_dora(base, root / "cancelling")
    base.save_pretrained(root / "cancel_model")
    state = load_file(str(paths["cancel"] / "adapter_model.safetensors"))
    prefix = f"base_model.model.{CANCEL_MODULE}"
    a, b = state[f"{prefix}.lora_A.weight"].double(), state[f"{prefix}.lora_B.weight"].double()
    weight = base.get_submodule(CANCEL_MODULE).weight.detach().double()
    magnitude = state[f"{prefix}.lora_magnitude_vector"].double()
    return magnitude / torch.linalg.vector_norm(weight + 2 * b @ a, dim=1)


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
    save_peft_adapter(
        base,
        root / "dora",
        1,
        r=8,
        lora_alpha=16,
        target_modules=ALL,
        rank_pattern={"down_proj": 4},
        use_dora=True,
    )
    save_peft_adapter(
        base,
        root / "dora_rs",
        2,
        r=4,
        lora_alpha=4,
        target_modules=["v_proj", "o_proj", "down_proj"],
        use_rslora=True,
        alpha_pattern={"o_proj": 12},
        use_dora=True,
    )
    make_peft_adapter(root / "model", root / "lora", r=4, lora_alpha=8, target_modules=ALL, seed=3)
    want: dict[str, dict[str, Any]] = {"float32": {}, "bfloat16": {}, "layer0": {}}
    with torch.inference_mode():
        for name in ("dora", "dora_rs", "lora"):
            peft = PeftModel.from_pretrained(copy.deepcopy(base), root / name).eval()
            want["float32"][name] = _run(peft)
            layer = peft.base_model.model.model.layers[0]
            x, x_down = _layer_inputs()
            want["layer0"][name] = {
                m: getattr(layer.self_attn if m.endswith(("q", "k", "v")) else layer.mlp, f"{m}_proj")(
                    x_down if m == "down" else x
                )
                for m in ("q", "k", "v", "gate", "up", "down")
            }
            want["bfloat16"][name] = _run(peft.to(torch.bfloat16))
    want["qwen2"] = _save_qwen2(root)
    want["cancel"] = _save_cancelling(root)
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
        _check_fused_layers(root, tp, want["layer0"])
        _check_transformers_tp(root, want["qwen2"])
        for loading in ("blocking", "background"):
            _check_eviction_and_reload(root, tp, want["float32"], loading)
        _check_fully_sharded_refused(root, rank, world)
        _check_cancelling_rows(root, tp, want["cancel"])
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


def _check_transformers_tp(root: Path, want: dict[str, Any]) -> None:
    """A Qwen2 cut by transformers' own ``tp_plan="auto"`` (``DTensor`` weights and q/k/v biases): the
    norms come from each rank's local weight, DoRA rows are rescaled around the local bias shard; rows
    equal PEFT's, base rows the cut base model's bit for bit."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        root / "qwen2", distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    with torch.inference_mode():
        base = _run(model, [0, 1])
    mgr = LoRAManager(model, [f"qwen2_dora={root / 'qwen2_dora'}"], max_loras_per_batch=1)
    assert mgr.tp is not None and mgr.tp.size == 2
    with torch.inference_mode(), mgr.batch(["qwen2_dora", None]):
        got = _run(model, [0, 1])
    _check_rows(got, want, base, ["qwen2_dora", None], [0, 1])
    mgr.detach()


def _check_fused_layers(root: Path, tp: TensorParallel, want: dict[str, dict[str, torch.Tensor]]) -> None:
    """Layer 0 as a framework cuts it, fused: qkv (q by rank, the one kv head replicated on both ranks),
    gate_up, and row-parallel down, on a packed step of DoRA, LoRA and base tokens. Each rank's output is
    its columns of PEFT's module outputs (each DoRA slice's factors are its own rows' of that slice), base
    tokens the layer's own output bit for bit."""
    from safetensors.torch import load_file

    from lora_pin.parallel import ParallelLayout, qkv_slices
    from lora_pin.parallel_fixtures import ColumnParallelLinear, RowParallelLinear

    weights = load_file(root / "model" / "model.safetensors")
    q, kv, _ = qkv_slices(tp, q_out=64, kv_out=16, num_kv_heads=1)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for i in range(2):  # both layers: the adapters' tensors of layer 1 must find their modules
        w = {k.rsplit(".", 2)[-2]: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
        layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        fused = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])
        attn.qkv_proj = ColumnParallelLinear(fused, ParallelLayout("column", tp, 64, (q, kv, kv)))
        mlp.gate_up_proj = ColumnParallelLinear(
            torch.cat([w["gate_proj"], w["up_proj"]]), ParallelLayout.column(tp, 64, 128, 128)
        )
        attn.o_proj = RowParallelLinear(w["o_proj"], tp)  # targeted by the adapters, not called here
        mlp.down_proj = RowParallelLinear(w["down_proj"], tp)
        layer.self_attn, layer.mlp = attn, mlp
        model.model.layers.append(layer)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    width = 128 // tp.size
    mgr = LoRAManager(
        model,
        [f"{n}={root / n}" for n in ("dora", "dora_rs", "lora")],
        max_loras_per_batch=3,
        max_lora_rank=8,
        fused_modules={
            "qkv_proj": [("q_proj", 64 // tp.size), ("k_proj", 16), ("v_proj", 16)],
            "gate_up_proj": [("gate_proj", width), ("up_proj", width)],
        },
        tp=tp,
    )
    x, x_down = _layer_inputs()
    x_local = x_down[:, tp.rank * width : (tp.rank + 1) * width].contiguous()
    with torch.inference_mode():
        base = [attn.qkv_proj(x), mlp.gate_up_proj(x), mlp.down_proj(x_local.clone())]
        step = mgr.prepare_step(NAMES, COUNTS)
        try:
            assert step.admitted == tuple(range(len(NAMES)))
            got = [attn.qkv_proj(x), mlp.gate_up_proj(x), mlp.down_proj(x_local.clone())]
        finally:
            mgr.finish(step)
    rows = slice(tp.rank * width, (tp.rank + 1) * width)
    token_names = [n for n, c in zip(NAMES, COUNTS, strict=True) for _ in range(c)]
    for t, name in enumerate(token_names):
        if name is None:
            assert all(torch.equal(g[t], b[t]) for g, b in zip(got, base, strict=True)), t
            continue
        out = want[name]
        qkv = [out["q"][t, slice(*q.rows)], out["k"][t, slice(*kv.rows)], out["v"][t, slice(*kv.rows)]]
        expected = [torch.cat(qkv), torch.cat([out["gate"][t, rows], out["up"][t, rows]]), out["down"][t]]
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g[t], e, rtol=RTOL_LAYER, atol=RTOL_LAYER, msg=f"token {t} ({name})")
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


def _check_cancelling_rows(root: Path, tp: TensorParallel, want: torch.Tensor) -> None:
    """Rows of ``W + s B A`` at 1 to 1e-6 of ``||W||`` in the row-parallel ``down_proj``, each rank holding
    half of every row's columns: the factors from the all-reduced parts are the float64 ones rounded once,
    alike on both ranks; a row that cancels exactly is refused by name on every rank, and nothing loads."""
    from lora_pin.parallel_fixtures import shard_llama

    model = shard_llama(_load(root, "cancel_model"), tp)
    adapters = root / "cancelling"
    mgr = LoRAManager(model, [f"cancel={adapters / 'cancel'}"], max_loras_per_batch=2, tp=tp)
    factor = mgr.host["cancel"].modules[CANCEL_MODULE].factor
    assert factor is not None
    torch.testing.assert_close(factor.double(), want, rtol=2**-23, atol=0)
    with pytest.raises(
        AdapterLoadError, match=rf"module '{CANCEL_MODULE}': output feature {ZERO_FEATURE}: .*zero"
    ):
        mgr.load("zero", adapters / "zero")
    assert "zero" not in mgr.registry
    mgr.detach()


def test_dora_at_tp_2_equals_peft_through_eviction_and_both_loadings(root: Path) -> None:
    mp.spawn(_worker, args=(2, str(root), _free_port()), nprocs=2, join=True)
