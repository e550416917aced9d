"""The device slot pool: layout, slot reuse without residue, clearing, atomic refusals, CUDA copies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lora_pin.errors import PoolError
from lora_pin.fixtures import make_peft_adapter
from lora_pin.weights import DevicePool, HostAdapter, LoRATargets, load_adapter

MAX_RANK = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Setup:
    targets: LoRATargets
    full: HostAdapter  # every module of both layers, rank 8 (v: 4)
    small: HostAdapter  # k_proj and up_proj of layer 0 only, rank 2
    paths: dict[str, Path]


@pytest.fixture(scope="session")
def setup(tmp_path_factory: pytest.TempPathFactory, tiny_llama: torch.nn.Module) -> Setup:
    root = tmp_path_factory.mktemp("pool")
    base = tiny_llama
    targets = LoRATargets.from_model(base)
    paths = {
        "full": make_peft_adapter(
            base, root / "full", r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"v_proj": 4}
        ),
        "small": make_peft_adapter(
            base,
            root / "small",
            r=2,
            lora_alpha=2,
            target_modules=["k_proj", "up_proj"],
            layers_to_transform=[0],
            seed=5,
        ),
    }
    full = load_adapter("full", paths["full"], targets, max_rank=MAX_RANK, dtype=torch.float32)
    small = load_adapter("small", paths["small"], targets, max_rank=MAX_RANK, dtype=torch.float32)
    return Setup(targets, full, small, paths)


def snapshot(pool: DevicePool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for g in pool.targets.groups:
        a, b, ranks, scalings, _ = pool.buffers(g.key)
        out += [a.clone(), b.clone(), ranks.clone(), scalings.clone()]
    return out


def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def test_layout_and_allocation(setup: Setup) -> None:
    pool = DevicePool(setup.targets, slots=3, max_rank=MAX_RANK, dtype=torch.float16)
    a, b, ranks, scalings, offsets = pool.buffers("model.layers.0.self_attn.qkv_proj")
    assert a.shape == (3, 3 * MAX_RANK, 64) and b.shape == (3, 128, MAX_RANK)
    assert ranks.dtype == torch.int32 and scalings.dtype == torch.float32 and ranks.shape == (3, 3)
    assert offsets == [0, 64, 96, 128]
    a, b, _, _, offsets = pool.buffers("model.layers.1.mlp.down_proj")
    assert a.shape == (3, MAX_RANK, 128) and b.shape == (3, 64, MAX_RANK) and offsets == [0, 64]
    per_layer = (3 * 8 * 64 + 128 * 8) + (8 * 64 + 64 * 8) + (2 * 8 * 64 + 256 * 8) + (8 * 128 + 64 * 8)
    # Per group also a DoRA factor per output row (fp16) and its int32 flag.
    factors = (128 + 64 + 256 + 64) * 2 + 4 * 4
    assert pool.slot_nbytes == 2 * (per_layer * 2 + (3 + 1 + 2 + 1) * 8 + factors)
    assert pool.nbytes == 3 * pool.slot_nbytes
    with pytest.raises(PoolError, match=r"no group .model.layers.0.qkv. \(groups: model.layers.0.self_at"):
        pool.buffers("model.layers.0.qkv")
    with pytest.raises(PoolError, match=r"slots \(0\) and max_rank \(8\) must both be positive"):
        DevicePool(setup.targets, slots=0, max_rank=MAX_RANK, dtype=torch.float16)
    with pytest.raises(PoolError, match="must be floating point"):
        DevicePool(setup.targets, slots=1, max_rank=MAX_RANK, dtype=torch.int8)


def test_slot_content_and_padding(setup: Setup) -> None:
    pool = DevicePool(setup.targets, slots=2, max_rank=MAX_RANK, dtype=torch.float32)
    pool.fill(1, setup.small)
    assert pool.occupant(1) == "small" and pool.occupant(0) is None
    host = setup.small.modules["model.layers.0.self_attn.qkv_proj"]
    assert host.ranks == (0, 2, 0)
    a, b, ranks, scalings, _ = pool.buffers("model.layers.0.self_attn.qkv_proj")
    assert ranks[1].tolist() == [0, 2, 0] and scalings[1].tolist() == [0.0, 1.0, 0.0]
    # k is slice 1: A rows [8, 10), B rows [64, 96) columns [0, 2); all else zero
    assert torch.equal(a[1, 8:10], host.a[2:4])
    assert torch.equal(b[1, 64:96, :2], host.b[64:96])
    mask_a = torch.ones_like(a[1], dtype=torch.bool)
    mask_a[8:10] = False
    mask_b = torch.ones_like(b[1], dtype=torch.bool)
    mask_b[64:96, :2] = False
    assert not a[1][mask_a].any() and not b[1][mask_b].any()
    assert a[1, 8:10].any() and b[1, 64:96, :2].any()
    assert not a[0].any() and not b[0].any()


def test_slot_reuse_leaves_no_residue(setup: Setup) -> None:
    reused = DevicePool(setup.targets, slots=2, max_rank=MAX_RANK, dtype=torch.float32)
    fresh = DevicePool(setup.targets, slots=2, max_rank=MAX_RANK, dtype=torch.float32)
    reused.fill(0, setup.full)
    reused.fill(1, setup.full)
    full_slot1 = [t[1].clone() for t in snapshot(reused)]
    reused.fill(0, setup.small)
    fresh.fill(0, setup.small)
    for got, want in zip(snapshot(reused), snapshot(fresh), strict=True):
        assert torch.equal(got[0], want[0])
    # the other slot kept the full adapter
    assert same([t[1] for t in snapshot(reused)], full_slot1)
    # groups the small adapter lacks are zero with rank 0 in slot 0
    a, b, ranks, scalings, _ = reused.buffers("model.layers.1.self_attn.qkv_proj")
    assert not a[0].any() and not b[0].any() and not ranks[0].any() and not scalings[0].any()
    assert a[1].any() and ranks[1].tolist() == [8, 8, 4]


def test_clear_zeroes_the_slot(setup: Setup) -> None:
    pool = DevicePool(setup.targets, slots=2, max_rank=MAX_RANK, dtype=torch.float32)
    pool.fill(0, setup.full)
    pool.fill(1, setup.full)
    pool.clear(0)
    assert pool.occupant(0) is None and pool.occupant(1) == "full"
    for t in snapshot(pool):
        assert not t[0].any() and t[1].any()


def test_refused_fill_leaves_the_pool_unchanged(setup: Setup) -> None:
    pool = DevicePool(setup.targets, slots=2, max_rank=MAX_RANK, dtype=torch.float32)
    pool.fill(0, setup.full)
    pool.fill(1, setup.small)
    before = snapshot(pool)
    unfused = LoRATargets.from_linears(setup.targets.linears, fuse=False)
    other_targets = load_adapter("u", setup.paths["small"], unfused, max_rank=MAX_RANK, dtype=torch.float32)
    half = load_adapter("h", setup.paths["small"], setup.targets, max_rank=MAX_RANK, dtype=torch.float16)
    cases = [
        (0, other_targets, r"adapter 'u' into slot 0: it was loaded for different model targets"),
        (1, half, r"adapter 'h' into slot 1: host dtype torch.float16 differs from the pool's torch.float32"),
        (2, setup.small, r"slot 2 out of range \[0, 2\)"),
        (-1, setup.small, r"slot -1 out of range"),
    ]
    for slot, adapter, message in cases:
        with pytest.raises(PoolError, match=message):
            pool.fill(slot, adapter)
        assert same(snapshot(pool), before)
        assert [pool.occupant(0), pool.occupant(1)] == ["full", "small"]
    small_pool = DevicePool(setup.targets, slots=1, max_rank=4, dtype=torch.float32)
    small_pool.fill(0, setup.small)
    kept = snapshot(small_pool)
    with pytest.raises(PoolError, match=r"adapter 'full' into slot 0: rank 8 exceeds the pool's max rank 4"):
        small_pool.fill(0, setup.full)
    assert same(snapshot(small_pool), kept) and small_pool.occupant(0) == "small"
    with pytest.raises(PoolError, match="slot 5 out of range"):
        pool.clear(5)
    assert same(snapshot(pool), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fill_is_ordered_before_compute(setup: Setup) -> None:
    full = load_adapter("full", setup.paths["full"], setup.targets, max_rank=MAX_RANK, dtype=torch.float16)
    small = load_adapter("small", setup.paths["small"], setup.targets, max_rank=MAX_RANK, dtype=torch.float16)
    assert full.pinned and small.pinned
    gpu = DevicePool(setup.targets, slots=2, max_rank=MAX_RANK, dtype=torch.float16, device="cuda")
    cpu = DevicePool(setup.targets, slots=2, max_rank=MAX_RANK, dtype=torch.float16)
    for pool in (gpu, cpu):
        pool.fill(0, full)
        pool.fill(1, full)
        event = pool.fill(0, small)
        assert (event is None) == (pool is cpu)
    # read on the current stream without synchronising first: the stream waits on the copy event
    got = [t.to("cpu", non_blocking=False) for t in snapshot(gpu)]
    assert same(got, snapshot(cpu))
    gpu.clear(1)
    torch.cuda.synchronize()
    assert all(not t[1].any() for t in snapshot(gpu))
