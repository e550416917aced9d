"""Adapter loading against PEFT as the oracle: config rules, refusals, host tier, path containment, CLI."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    DuplicateAdapterError,
    PathNotAllowedError,
    SpecError,
    UnsafeFormatError,
)
from lora_pin.fixtures import make_peft_adapter
from lora_pin.weights import DevicePool, HostTier, LoRATargets, load_adapter, open_adapter

MAX_RANK = 16
# name -> make_peft_adapter keyword arguments; together they cover mixed ranks, rslora, rank/alpha patterns,
# partial target modules, a subset of layers and a regex target_modules.
ADAPTERS: dict[str, dict[str, Any]] = {
    "mixed": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"v_proj": 4, "model.layers.1.mlp.down_proj": 2},
        alpha_pattern={"model.layers.1.self_attn.q_proj": 3, "up_proj": 5},
        seed=1,
    ),
    "rslora": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        use_rslora=True,
        rank_pattern={"up_proj": 16},
        seed=2,
    ),
    "partial": dict(
        r=16, lora_alpha=7, target_modules=["o_proj", "gate_proj"], layers_to_transform=[1], seed=3
    ),
    "regex": dict(r=2, lora_alpha=4, target_modules=r".*\.(k_proj|down_proj)", seed=4),
}


@dataclass
class World:
    """Everything the tests share: a tiny Llama on disk, its targets, adapters and PEFT's view of them."""

    root: Path
    base_dir: Path
    targets: LoRATargets
    adapters: dict[str, Path]
    peft: torch.nn.Module


@pytest.fixture(scope="session")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: Path,
    tiny_llama: torch.nn.Module,
    make_adapters: Callable[..., dict[str, Path]],
) -> World:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("weights")
    base_dir = tiny_llama_dir
    targets = LoRATargets.from_model(tiny_llama)
    adapters = make_adapters(root / "adapters", ADAPTERS)
    oracle_base = AutoModelForCausalLM.from_pretrained(base_dir)
    names = list(adapters)
    peft = PeftModel.from_pretrained(oracle_base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    return World(root, base_dir, targets, adapters, peft)


def peft_lora_layers(world: World) -> dict[str, torch.nn.Module]:
    """PEFT's LoRA layers by module key relative to the base model (``model.layers.0.self_attn.q_proj``)."""
    prefix = "base_model.model."
    return {k.removeprefix(prefix): m for k, m in world.peft.named_modules() if hasattr(m, "lora_A")}


def pool_delta(pool: DevicePool, slot: int, world: World, key: str) -> tuple[torch.Tensor, int, float]:
    """``scaling * B @ A`` in fp64 for module ``key`` read back from the pool, with its rank and scaling."""
    group, s = world.targets.group_of(key)
    a, b, ranks, scalings, offsets = pool.buffers(group.key)
    r = pool.max_rank
    a_s = a[slot, s * r : (s + 1) * r].double()
    b_s = b[slot, offsets[s] : offsets[s + 1]].double()
    scaling = float(scalings[slot, s])
    return scaling * b_s @ a_s, int(ranks[slot, s]), scaling


# ---------------------------------------------------------------- targets


def test_targets_describe_every_linear_and_fuse_groups(world: World) -> None:
    t = world.targets
    assert t.num_layers == 2
    assert len(t.linears) == 14
    q = t.linear("model.layers.0.self_attn.q_proj")
    k = t.linear("model.layers.1.self_attn.k_proj")
    down = t.linear("model.layers.1.mlp.down_proj")
    assert q is not None and (q.in_features, q.out_features) == (64, 64)
    assert k is not None and (k.in_features, k.out_features) == (64, 32)  # 2 kv heads of 16
    assert down is not None and (down.in_features, down.out_features) == (128, 64)
    assert [g.name for g in t.groups if g.layer == 0] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    qkv = t.group("model.layers.0.self_attn.qkv_proj")
    assert qkv.slice_offsets == (0, 64, 96, 128) and qkv.in_features == 64
    assert t.group("model.layers.1.mlp.gate_up_proj").slice_offsets == (0, 128, 256)
    assert t.group_of("model.layers.1.self_attn.v_proj") == (t.group("model.layers.1.self_attn.qkv_proj"), 2)

    unfused = LoRATargets.from_linears(t.linears, fuse=False)
    assert len(unfused.groups) == 14 and all(g.n_slices == 1 for g in unfused.groups)
    assert unfused != t


def test_targets_on_meta_device_and_subset(world: World) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(world.base_dir))
    assert LoRATargets.from_model(model) == world.targets
    subset = LoRATargets.from_model(model, ["q_proj", "v_proj"])
    # q and v without k cannot fuse: two single-slice groups per layer
    assert [(g.layer, g.name) for g in subset.groups] == [
        (0, "q_proj"),
        (0, "v_proj"),
        (1, "q_proj"),
        (1, "v_proj"),
    ]


# ---------------------------------------------------------------- pool equals PEFT


@pytest.mark.parametrize("fuse", [True, False])
def test_pool_deltas_equal_peft(world: World, fuse: bool) -> None:
    targets = world.targets if fuse else LoRATargets.from_linears(world.targets.linears, fuse=False)
    pool = DevicePool(targets, slots=len(ADAPTERS), max_rank=MAX_RANK, dtype=torch.float32)
    hosts = [
        load_adapter(n, world.adapters[n], targets, max_rank=MAX_RANK, dtype=torch.float32) for n in ADAPTERS
    ]
    for slot, host in enumerate(hosts):
        pool.fill(slot, host)
    layers = peft_lora_layers(world)
    tw = World(world.root, world.base_dir, targets, world.adapters, world.peft)
    for slot, name in enumerate(ADAPTERS):
        covered = 0
        for linear in targets.linears:
            delta, rank, scaling = pool_delta(pool, slot, tw, linear.key)
            layer = layers.get(linear.key)
            if layer is None or name not in layer.lora_A:
                assert rank == 0 and scaling == 0.0 and not delta.any(), (name, linear.key)
                continue
            covered += 1
            a = layer.lora_A[name].weight.double()
            b = layer.lora_B[name].weight.double()
            expected = layer.scaling[name] * b @ a
            assert rank == layer.r[name], (name, linear.key)
            assert math.isclose(scaling, layer.scaling[name], rel_tol=1e-6), (name, linear.key)
            torch.testing.assert_close(delta, expected, rtol=1e-6, atol=1e-9)
        assert covered > 0
        assert hosts[slot].tensors_applied == 2 * covered


def test_known_scalings_follow_peft_rules(world: World) -> None:
    host = load_adapter(
        "mixed", world.adapters["mixed"], world.targets, max_rank=MAX_RANK, dtype=torch.float32
    )
    qkv1 = host.modules["model.layers.1.self_attn.qkv_proj"]
    assert qkv1.ranks == (8, 8, 4)
    assert qkv1.scalings == (3 / 8, 16 / 8, 16 / 4)  # alpha_pattern on layer-1 q, rank_pattern on v
    assert host.modules["model.layers.0.mlp.gate_up_proj"].scalings == (16 / 8, 5 / 8)
    assert host.modules["model.layers.1.mlp.down_proj"].ranks == (2,)
    rs = load_adapter(
        "rslora", world.adapters["rslora"], world.targets, max_rank=MAX_RANK, dtype=torch.float32
    )
    assert rs.modules["model.layers.0.self_attn.qkv_proj"].scalings == (8 / 2, 0.0, 8 / 2)
    assert rs.modules["model.layers.0.mlp.gate_up_proj"].ranks == (0, 16)
    assert rs.modules["model.layers.0.mlp.gate_up_proj"].scalings == (0.0, 8 / 4)
    assert set(rs.modules) == {
        f"model.layers.{i}.{group}" for i in (0, 1) for group in ("self_attn.qkv_proj", "mlp.gate_up_proj")
    }


def test_pool_forward_equals_peft_forward(world: World) -> None:
    """The pool's per-slice shrink/expand reproduces PEFT's LoRA layer output minus its base output."""
    name = "mixed"
    host = load_adapter(name, world.adapters[name], world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    pool = DevicePool(world.targets, slots=3, max_rank=MAX_RANK, dtype=torch.float32)
    pool.fill(2, host)
    world.peft.set_adapter(name)
    x_by_in = {n: torch.randn(5, n, generator=torch.Generator().manual_seed(n)) for n in (64, 128)}
    for key, layer in peft_lora_layers(world).items():
        group, s = world.targets.group_of(key)
        a, b, _, scalings, offsets = pool.buffers(group.key)
        x = x_by_in[group.in_features]
        with torch.no_grad():
            want = (layer(x) - layer.base_layer(x)).double()
        r = pool.max_rank
        shrunk = x.double() @ a[2, s * r : (s + 1) * r].double().T
        got = float(scalings[2, s]) * shrunk @ b[2, offsets[s] : offsets[s + 1]].double().T
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_host_tensors_in_serving_dtype(world: World) -> None:
    host = load_adapter(
        "mixed", world.adapters["mixed"], world.targets, max_rank=MAX_RANK, dtype=torch.bfloat16
    )
    f32 = load_adapter(
        "mixed", world.adapters["mixed"], world.targets, max_rank=MAX_RANK, dtype=torch.float32
    )
    assert host.dtype == torch.bfloat16 and host.max_rank == 8 and host.ranks == (2, 4, 8)
    for key, module in host.modules.items():
        assert module.a.dtype == module.b.dtype == torch.bfloat16
        torch.testing.assert_close(module.a.float(), f32.modules[key].a, rtol=1e-2, atol=1e-2)
    assert host.nbytes * 2 == f32.nbytes
    # every layer has 7 modules; rank 8 except v (4) and layer-1 down (2)
    expected = 0
    for linear in world.targets.linears:
        r = 4 if linear.module == "v_proj" else 2 if linear.key == "model.layers.1.mlp.down_proj" else 8
        expected += r * (linear.in_features + linear.out_features) * 2
    assert host.device_bytes == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_host_tensors_pinned_with_cuda(world: World) -> None:
    host = load_adapter(
        "mixed", world.adapters["mixed"], world.targets, max_rank=MAX_RANK, dtype=torch.float16
    )
    assert host.pinned


def test_host_tier_owns_its_memory(world: World, tmp_path: Path) -> None:
    """Rewriting the adapter file in place after loading changes nothing in the host tier (no mmap alias)."""
    d = copy_adapter(world, tmp_path / "rewritten", source="regex")
    host = load_adapter("r", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    before = {k: (m.a.clone(), m.b.clone()) for k, m in host.modules.items()}
    state = load_file(d / "adapter_model.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, d / "adapter_model.safetensors")
    for key, module in host.modules.items():
        assert torch.equal(module.a, before[key][0]) and torch.equal(module.b, before[key][1])


def test_pickle_refused_unless_allowed(world: World, tmp_path: Path) -> None:
    src = world.adapters["partial"]
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(src / "adapter_config.json", d)
    torch.save(load_file(src / "adapter_model.safetensors"), d / "adapter_model.bin")
    with pytest.raises(
        UnsafeFormatError, match=r"'pickled'.*adapter_model\.bin.*arbitrary code.*allow_pickle"
    ):
        load_adapter("pickled", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    got = load_adapter("pickled", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32, allow_pickle=True)
    want = load_adapter("partial", src, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    assert got.modules.keys() == want.modules.keys()
    for key in want.modules:
        assert torch.equal(got.modules[key].a, want.modules[key].a)
        assert torch.equal(got.modules[key].b, want.modules[key].b)


# ---------------------------------------------------------------- refusals


def copy_adapter(
    world: World,
    dest: Path,
    *,
    source: str = "mixed",
    config: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of an adapter with its config and/or tensors edited."""
    src = world.adapters[source]
    dest.mkdir(parents=True)
    data = orjson.loads((src / "adapter_config.json").read_bytes())
    if config is not None:
        config(data)
    (dest / "adapter_config.json").write_bytes(orjson.dumps(data))
    state = load_file(src / "adapter_model.safetensors")
    if tensors is not None:
        tensors(state)
    save_file(state, dest / "adapter_model.safetensors")
    return dest


Q0A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _rename_all(state: dict[str, torch.Tensor]) -> None:
    for key in list(state):
        state[key.replace("model.layers", "transformer.h")] = state.pop(key)


CONFIG_REFUSALS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("dora", lambda c: c.update(use_dora="yes"), r"field 'use_dora' must be a boolean"),
    ("bias", lambda c: c.update(bias="all"), r"field 'bias' is 'all'"),
    ("save", lambda c: c.update(modules_to_save=["lm_head"]), r"field 'modules_to_save' is \['lm_head'\]"),
    ("ia3", lambda c: c.update(peft_type="IA3"), r"field 'peft_type' is 'IA3'; only LORA"),
    ("lora_bias", lambda c: c.update(lora_bias=True), r"field 'lora_bias'"),
    ("bad_r", lambda c: c.update(r="8"), r"field 'r' must be a positive integer"),
    ("no_targets", lambda c: c.update(target_modules=[]), r"field 'target_modules' must be"),
    (
        "bad_regex",
        lambda c: c.update(rank_pattern={"(": 4}),
        r"field 'rank_pattern' key '\(' is not a valid regex",
    ),
    (
        "lacks",
        lambda c: c["target_modules"].append("c_attn"),
        r"'target_modules' names 'c_attn', which is not",
    ),
    ("rank", lambda c: c.update(rank_pattern={}), r"has rank 4 but field 'r'/'rank_pattern' gives 8"),
    *[
        (
            init,
            lambda c, init=init: c.update(init_lora_weights=init),
            rf"'init_lora_weights' is '{init}'.*base",
        )
        for init in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga")
    ],
]


@pytest.mark.parametrize(("case", "edit", "message"), CONFIG_REFUSALS, ids=[c[0] for c in CONFIG_REFUSALS])
def test_config_refusals(
    world: World, tmp_path: Path, case: str, edit: Callable[..., None], message: str
) -> None:
    d = copy_adapter(world, tmp_path / case, config=edit)
    with pytest.raises(AdapterLoadError, match=message) as info:
        load_adapter(f"ad-{case}", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    assert f"'ad-{case}'" in str(info.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "eva", "mica"])
def test_inits_that_leave_the_base_weights_alone_load(world: World, tmp_path: Path, init: Any) -> None:
    d = copy_adapter(world, tmp_path / "init", config=lambda c: c.update(init_lora_weights=init))
    assert load_adapter("init", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32).modules


TENSOR_REFUSALS: list[tuple[str, Callable[[dict[str, Any]], None] | None, Callable[..., None], str]] = [
    (
        "shape",
        None,
        lambda s: s.update({Q0A: torch.ones(8, 63)}),
        r"tensors '.*layers\.0\.self_attn\.q_proj\.lora_A\.weight' \[8, 63\].*"
        r"expected \[r, 64\] and \[64, r\]",
    ),
    (
        "unused",
        None,
        lambda s: s.update({"base_model.model.lm_head.weight": torch.ones(2, 2)}),
        r"1 tensor\(s\) would be unused: 'base_model\.model\.lm_head\.weight'",
    ),
    ("half_pair", None, lambda s: s.pop(Q0B), r"would be unused: '.*q_proj\.lora_A\.weight'"),
    (
        "missing",
        lambda c: c["target_modules"].remove("o_proj"),
        lambda s: None,
        r"tensors for modules the config's target_modules/layers_to_transform exclude: .*o_proj",
    ),
    (
        "no_tensor",
        None,
        lambda s: (s.pop(Q0A), s.pop(Q0B)),
        r"config targets modules with no lora_A/lora_B tensors: 'model\.layers\.0\.self_attn\.q_proj'",
    ),
    (
        "no_match",
        lambda c: c.update(target_modules=".*", rank_pattern={}, alpha_pattern={}),
        _rename_all,
        r"no tensor matches any LoRA target of this model \(it would silently serve base-model output\)",
    ),
]


@pytest.mark.parametrize(
    ("case", "config", "tensors", "message"), TENSOR_REFUSALS, ids=[c[0] for c in TENSOR_REFUSALS]
)
def test_tensor_refusals(
    world: World,
    tmp_path: Path,
    case: str,
    config: Callable[..., None] | None,
    tensors: Callable[..., None],
    message: str,
) -> None:
    d = copy_adapter(world, tmp_path / case, config=config, tensors=tensors)
    with pytest.raises(AdapterLoadError, match=message) as info:
        load_adapter(f"ad-{case}", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    assert f"'ad-{case}'" in str(info.value) and "adapter_model.safetensors" in str(info.value)


def test_rank_above_pool_max_rank_refused(world: World) -> None:
    with pytest.raises(AdapterLoadError, match=r"'mixed'.*rank 8, above the pool's max rank 4"):
        load_adapter("mixed", world.adapters["mixed"], world.targets, max_rank=4, dtype=torch.float32)


def test_target_the_model_lacks_refused(world: World) -> None:
    q_only = LoRATargets.from_model(world.peft.get_base_model(), ["q_proj"])
    with pytest.raises(
        AdapterLoadError, match=r"'rslora'.*'target_modules' names 'up_proj', which is not a LoRA"
    ):
        load_adapter("rslora", world.adapters["rslora"], q_only, max_rank=MAX_RANK, dtype=torch.float32)


def test_real_dora_adapter_read_with_its_magnitudes(world: World, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(world.base_dir)
    d = make_peft_adapter(
        base, tmp_path / "dora", r=4, lora_alpha=4, target_modules=["q_proj"], use_dora=True
    )
    adapter = load_adapter("dora", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    assert adapter.dora
    module = next(iter(adapter.modules.values()))
    # Without the model's base weights the factors are not computed (see tests/weights/test_dora.py).
    assert module.magnitude is not None and module.factor is None
    assert module.magnitude.shape == (module.b.shape[0],) and bool(module.magnitude[:64].gt(0).all())


def test_not_an_adapter_directory(world: World, tmp_path: Path) -> None:
    with pytest.raises(AdapterLoadError, match=r"'x'.*is not a directory"):
        load_adapter("x", tmp_path / "nope", world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    with pytest.raises(AdapterLoadError, match=r"'x'.*adapter_config\.json does not exist"):
        load_adapter("x", tmp_path, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterLoadError, match=r"'x'.*not valid JSON"):
        load_adapter("x", tmp_path, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"]}')
    with pytest.raises(
        AdapterLoadError, match=r"'x'.*no adapter_model\.safetensors \(or adapter_model\.bin\)"
    ):
        load_adapter("x", tmp_path, world.targets, max_rank=MAX_RANK, dtype=torch.float32)


# ---------------------------------------------------------------- path containment


def test_path_containment(world: World, tmp_path: Path) -> None:
    root = tmp_path / "root"
    inside = copy_adapter(world, root / "good")
    outside = copy_adapter(world, tmp_path / "outside")

    def load(path: str | Path) -> object:
        return load_adapter(
            "p", path, world.targets, max_rank=MAX_RANK, dtype=torch.float32, allowed_roots=[root]
        )

    load(inside)
    with pytest.raises(
        PathNotAllowedError, match=r"'p': path .*outside.* resolves to .*outside every allowed root"
    ):
        load(outside)
    with pytest.raises(PathNotAllowedError, match=r"contains '\.\.'"):
        load(f"{root}/good/../good")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PathNotAllowedError, match=r"escape' resolves to .*outside"):
        load(root / "escape")
    sneaky = copy_adapter(world, root / "sneaky")
    (sneaky / "adapter_model.safetensors").unlink()
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(PathNotAllowedError, match=r"adapter_model\.safetensors resolves to .*outside"):
        load(sneaky)
    assert isinstance(PathNotAllowedError("x"), PermissionError)
    # without allowed_roots everything readable loads, symlinks included
    load_adapter("p", root / "escape", world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    # a root given through a symlink is compared by its real path
    (tmp_path / "root_link").symlink_to(root, target_is_directory=True)
    load_adapter(
        "p",
        inside,
        world.targets,
        max_rank=MAX_RANK,
        dtype=torch.float32,
        allowed_roots=[tmp_path / "root_link"],
    )
    assert os.path.islink(tmp_path / "root_link")


# ---------------------------------------------------------------- host tier atomicity


def test_host_tier_is_unchanged_by_failures(world: World, tmp_path: Path) -> None:
    tier = HostTier(
        world.targets, max_rank=MAX_RANK, dtype=torch.float32, allowed_roots=[world.root, tmp_path]
    )
    first = tier.load("mixed", world.adapters["mixed"])
    before = (list(tier), tier.nbytes)
    failures = [
        ("dora", copy_adapter(world, tmp_path / "dora", config=lambda c: c.update(use_dora=True))),
        (
            "shape",
            copy_adapter(world, tmp_path / "shape", tensors=lambda s: s.update({Q0A: torch.ones(8, 63)})),
        ),
        ("far", tmp_path / ".." / "x"),
    ]
    for name, path in failures:
        with pytest.raises(AdapterLoadError):
            tier.load(name, path)
        assert (list(tier), tier.nbytes) == before and name not in tier
    with pytest.raises(DuplicateAdapterError, match="'mixed' is already in the host tier"):
        tier.load("mixed", world.adapters["regex"])
    assert tier["mixed"] is first
    with pytest.raises(AdapterNotFoundError, match=r"'nope' is not in the host tier \(held: 'mixed'\)"):
        tier.drop("nope")
    assert tier.drop("mixed") is first and len(tier) == 0


# ---------------------------------------------------------------- CLI


def run_inspect(*argv: str) -> int:
    from lora_pin.cli import inspect_cmd

    parser = argparse.ArgumentParser()
    inspect_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["inspect", *argv])
    return int(args.run(args))


def test_inspect_prints_summary(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run_inspect(str(world.adapters["rslora"]), "--model", str(world.base_dir), "--dtype", "float16") == 0
    )
    out = capsys.readouterr().out
    assert "rank:           4, 16" in out
    assert "alpha:          8" in out
    assert "scaling:        2, 4 (rslora)" in out
    assert "target modules: q_proj, up_proj, v_proj" in out
    assert "layers:         2 (0, 1)" in out
    assert "tensors:        12" in out
    # per layer: q 4*(64+64) + v 4*(64+32) + up 16*(64+128) = 3968 params, fp16
    assert "device bytes:   15872 (float16)" in out
    assert "(validated)" in out


def test_inspect_reports_why_not(world: World, tmp_path: Path) -> None:
    d = copy_adapter(world, tmp_path / "dora", config=lambda c: c.update(use_dora=True))
    with pytest.raises(AdapterLoadError, match="use_dora"):
        run_inspect(str(d))
    with pytest.raises(AdapterLoadError, match=r"ranks above the max rank 4"):
        run_inspect(str(world.adapters["mixed"]), "--max-rank", "4")
    with pytest.raises(AdapterLoadError, match=r"max rank 4"):
        run_inspect(str(world.adapters["mixed"]), "--max-rank", "4", "--model", str(world.base_dir))
    # --model must be a local model folder: transformers would take anything else for a Hub id.
    with pytest.raises(SpecError, match="is not a folder"):
        run_inspect(str(world.adapters["mixed"]), "--model", str(tmp_path / "nowhere"))
    with pytest.raises(SpecError, match=r"has no config\.json"):
        run_inspect(str(world.adapters["mixed"]), "--model", str(tmp_path))


def test_open_adapter_reads_no_tensor(world: World) -> None:
    file = open_adapter("m", world.adapters["mixed"])
    assert file.dtype == torch.float32 and len(file.pairs) == 14 and not file.unused
    assert file.config.rank_for("model.layers.0.self_attn.v_proj") == 4
    assert file.config.rank_for("model.layers.1.mlp.down_proj") == 2
    assert file.config.rank_for("model.layers.0.mlp.down_proj") == 8


EXPONENTIAL = "(?:.|.)" * 30 + "X"  # 2^30 ways per module name for a backtracking engine
# CPU seconds of the loading thread a config's patterns may cost (milliseconds in linear time).
CONFIG_CPU_S = 2.0


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        (
            "target",
            lambda c: c.update(target_modules=EXPONENTIAL),
            "tensors for modules the config's target_modules",
        ),
        (
            "rank_key",
            lambda c: c["rank_pattern"].update({EXPONENTIAL: 4}),
            "field 'rank_pattern' key .* matches no module",
        ),
        (
            "alpha_key",
            lambda c: c["alpha_pattern"].update({EXPONENTIAL: 4}),
            "field 'alpha_pattern' key .* matches no module",
        ),
        ("exclude", lambda c: c.update(exclude_modules=EXPONENTIAL), None),
        ("lookahead", lambda c: c.update(target_modules=r"^(?!.*mlp).*\.q_proj"), "uses look-around"),
    ],
)
def test_config_regexes_cannot_stall_a_load(
    world: World, tmp_path: Path, case: str, edit: Callable[..., None], message: str | None
) -> None:
    d = copy_adapter(world, tmp_path / case, config=edit)
    start = time.thread_time()
    if message is None:
        load_adapter("ad", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    else:
        with pytest.raises(AdapterLoadError, match=message):
            load_adapter("ad", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    # Python's backtracking re took about 11 s for the target case at 26 groups, 16x that at 30. The
    # patterns are matched on this thread: its own CPU time, which a busy machine does not add to.
    assert time.thread_time() - start < CONFIG_CPU_S


def test_a_config_at_the_entry_limit_loads_fast_and_as_peft_ranks_it(world: World, tmp_path: Path) -> None:
    from lora_pin.weights.patterns import MAX_PATTERN_ENTRIES

    def fill(c: dict[str, Any]) -> None:
        # "v_proj" first: it keeps rank 4 for v_proj; every later key reaches its module too late to count.
        keys = (
            MAX_PATTERN_ENTRIES - len(c["target_modules"]) - len(c["alpha_pattern"]) - len(c["rank_pattern"])
        )
        names = c["target_modules"]
        c["rank_pattern"] |= {f"{names[i % len(names)]}|unused_{i}": 8 for i in range(keys)}

    d = copy_adapter(world, tmp_path / "many", config=fill)
    start = time.thread_time()
    many = load_adapter("many", d, world.targets, max_rank=MAX_RANK, dtype=torch.float32)
    assert time.thread_time() - start < CONFIG_CPU_S
    plain = load_adapter(
        "plain", world.adapters["mixed"], world.targets, max_rank=MAX_RANK, dtype=torch.float32
    )
    assert {k: (m.ranks, m.scalings) for k, m in many.modules.items()} == {
        k: (m.ranks, m.scalings) for k, m in plain.modules.items()
    }


def test_inspect_checks_an_adapter_against_a_non_llama_model(tmp_path: Path) -> None:
    """``--model`` builds the model's own targets (every linear layer, by full key): a GPT-2 adapter on
    ``attn.c_proj`` and ``mlp.c_proj`` validates, where Llama's default names found nothing."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=96)
    ).save_pretrained(model_dir)
    base = GPT2LMHeadModel.from_pretrained(model_dir)
    cfg = LoraConfig(
        r=2, lora_alpha=4, target_modules=["c_proj"], fan_in_fan_out=True, init_lora_weights=False
    )
    get_peft_model(base, cfg).save_pretrained(tmp_path / "adapter")
    assert run_inspect(str(tmp_path / "adapter"), "--model", str(model_dir)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["read-in-place", "converted"])
def test_a_nan_in_any_tensor_is_refused_naming_it(world: World, tmp_path: Path, dtype: torch.dtype) -> None:
    """The finiteness check runs once over the adapter's whole slab; whichever tensor holds the NaN (A or
    B, a fused slice read in place or a padded one copied over) is the one the error names."""
    names = sorted(load_file(world.adapters["mixed"] / "adapter_model.safetensors"))
    for i, tensor_name in enumerate(names):

        def poison(state: dict[str, torch.Tensor], name: str = tensor_name, at: int = i) -> None:
            flat = state[name].view(-1)
            flat[at % flat.numel()] = float("nan")

        d = copy_adapter(world, tmp_path / f"nan{i}", tensors=poison)
        with pytest.raises(AdapterLoadError) as info:
            load_adapter(f"nan{i}", d, world.targets, max_rank=MAX_RANK, dtype=dtype)
        assert f"tensor {tensor_name!r} has 1 NaN/Inf value(s)" in str(info.value)
        assert str(dtype) in str(info.value)
