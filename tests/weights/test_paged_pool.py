"""The paged device pool: each adapter's rank blocks in its pages (checked against the adapter's own host
tensors), rows past its rank zero, other pages' entries rank 0, refusals that change nothing, a page taken
from another slot counting as that slot's write, bytes and refusals at construction (targets that cannot
be paged: tests/model/test_paged_manager.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lora_pin.errors import PoolError
from lora_pin.fixtures import make_peft_adapter
from lora_pin.weights import HostAdapter, LoRATargets, PagedDevicePool, load_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAGE_RANK = 8
MAX_RANK = 24


@dataclass
class Setup:
    targets: LoRATargets
    adapters: dict[str, HostAdapter]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tiny_llama: torch.nn.Module) -> Setup:
    root = tmp_path_factory.mktemp("paged-pool")
    targets = LoRATargets.from_model(tiny_llama)
    specs = {
        # rank 4 in one page with v at 2 (a partial page), a rank 20 over three pages (the last partial),
        # a rank 8 on q and v of layer 0 only (the other groups zero, rank 0).
        "r4": dict(r=4, lora_alpha=8, target_modules=ALL, rank_pattern={"v_proj": 2}, seed=1),
        "r20": dict(r=20, lora_alpha=10, target_modules=ALL, seed=2),
        "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], layers_to_transform=[0], seed=3),
    }
    adapters = {
        name: load_adapter(
            name,
            make_peft_adapter(tiny_llama, root / name, **kwargs),
            targets,
            max_rank=MAX_RANK,
            dtype=torch.float32,
        )
        for name, kwargs in specs.items()
    }
    return Setup(targets, adapters)


def slot_view(pool: PagedDevicePool, key: str, pages: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A slot's ``A [n_slices, pages * page_rank, in]`` and ``B [out_total, pages * page_rank]``, gathered
    from its pages in rank order."""
    buf = pool.group_buffers(key)
    index = torch.tensor(pages)
    n, count = buf.group.n_slices, len(pages)
    a = (
        buf.a.index_select(0, index)
        .view(count, n, PAGE_RANK, -1)
        .transpose(0, 1)
        .reshape(n, count * PAGE_RANK, -1)
    )
    b = buf.b.index_select(0, index).permute(1, 0, 2).reshape(buf.b.shape[1], -1)
    return a, b


def snapshot(pool: PagedDevicePool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for g in pool.targets.groups:
        buf = pool.group_buffers(g.key)
        assert buf.factors is not None and buf.dora is not None
        out += [t.clone() for t in (buf.a, buf.b, buf.ranks, buf.scalings, buf.factors, buf.dora)]
    return out


def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def assert_holds(pool: PagedDevicePool, slot: int, adapter: HostAdapter, pages: tuple[int, ...]) -> None:
    """``slot``'s pages hold exactly ``adapter``'s host tensors, zero past its rank and in the groups it
    does not target; its entries are the adapter's, those of its other pages rank 0."""
    for g in pool.targets.groups:
        buf = pool.group_buffers(g.key)
        a, b = slot_view(pool, g.key, pages)
        module = adapter.modules.get(g.key)
        if module is None:
            assert not a.any() and not b.any() and not buf.ranks[slot].any(), g.key
            continue
        n = g.n_slices
        rank = module.a.shape[0] // n
        assert torch.equal(a[:, :rank], module.a.view(n, rank, -1)), g.key
        assert not a[:, rank:].any() and not b[:, rank:].any(), g.key
        assert torch.equal(b[:, :rank], module.b), g.key
        assert torch.equal(buf.ranks[slot], module.rank_tensor), g.key
        assert torch.equal(buf.scalings[slot], module.scaling_tensor), g.key
        for page in pages[1:]:
            assert not buf.ranks[page].any() and not buf.scalings[page].any(), (g.key, page)


def test_each_adapters_ranks_are_in_its_pages_in_rank_order(setup: Setup) -> None:
    pool = PagedDevicePool(
        setup.targets, pages=7, page_rank=PAGE_RANK, max_rank=MAX_RANK, dtype=torch.float32
    )
    a, b, ranks, _, offsets = pool.buffers("model.layers.0.self_attn.qkv_proj")
    assert a.shape == (7, 3 * PAGE_RANK, 64) and b.shape == (7, 128, PAGE_RANK) and ranks.shape == (7, 3)
    assert offsets == [0, 64, 96, 128]
    # Scattered, descending pages: a layout that read pages in table order by accident would not pass.
    tables = {"r20": (5, 1, 3), "r4": (0,), "qv8": (6,)}
    for name, pages in tables.items():
        pool.fill(pages[0], setup.adapters[name], pages)
    for name, pages in tables.items():
        assert_holds(pool, pages[0], setup.adapters[name], pages)
        assert pool.occupant(pages[0]) == name and pool.pages_of(pages[0]) == pages
    assert pool.live_slots() == {5, 0, 6}


def test_a_page_reused_keeps_nothing_of_its_previous_adapter(setup: Setup) -> None:
    pool = PagedDevicePool(
        setup.targets, pages=4, page_rank=PAGE_RANK, max_rank=MAX_RANK, dtype=torch.float32
    )
    pool.fill(0, setup.adapters["r20"], (0, 1, 2))
    writes = pool.write_counts()
    # Page 1 (the second page of slot 0) becomes r4's slot: slot 0's contents are gone.
    pool.fill(1, setup.adapters["r4"], [1])
    assert_holds(pool, 1, setup.adapters["r4"], (1,))
    assert pool.writes(0) == writes[0] + 1 and pool.writes(1) == writes[1] + 1
    assert pool.occupant(0) is None and pool.pages_of(0) == () and pool.live_slots() == {1}
    for g in pool.targets.groups:
        assert not pool.group_buffers(g.key).ranks[0].any(), g.key
    # Slot 0's page 0 taken by the tail of an adapter whose slot is page 3: its entries stay rank 0.
    pool.fill(3, setup.adapters["r20"], (3, 0, 2))
    assert_holds(pool, 3, setup.adapters["r20"], (3, 0, 2))
    assert_holds(pool, 1, setup.adapters["r4"], (1,))
    pool.release(3)
    assert pool.live_slots() == {1} and pool.pages_of(3) == ()
    for g in pool.targets.groups:
        buf = pool.group_buffers(g.key)
        assert not buf.ranks[3].any() and buf.a[3].any() == (g.key in setup.adapters["r20"].modules)
    pool.clear(1)
    for g in pool.targets.groups:
        buf = pool.group_buffers(g.key)
        assert not buf.a[1].any() and not buf.b[1].any() and not buf.ranks[1].any()
    assert pool.occupant(1) is None


def test_refused_fills_change_nothing(setup: Setup) -> None:
    pool = PagedDevicePool(
        setup.targets, pages=5, page_rank=PAGE_RANK, max_rank=MAX_RANK, dtype=torch.float32
    )
    pool.fill(0, setup.adapters["r20"], (0, 2, 4))
    pool.fill(1, setup.adapters["r4"], (1,))
    before, writes = snapshot(pool), pool.write_counts()
    cases = [
        (3, setup.adapters["r20"], (3,), r"rank 20 needs 3 pages of page_rank=8, given 1"),
        (
            3,
            setup.adapters["r4"],
            (2,),
            r"pages \[2\] must be distinct pages in \[0, 5\), the first being the slot",
        ),
        (3, setup.adapters["r20"], (3, 3, 2), r"must be distinct pages"),
        (3, setup.adapters["r4"], (3, 5), r"must be distinct pages in \[0, 5\)"),
        (3, setup.adapters["r4"], (), r"pages \[\] must be"),
        (5, setup.adapters["r4"], (5,), r"slot 5 out of range \[0, 5\)"),
        # Slot 0's pages are free to take; still nothing may change when the adapter is refused.
        (2, setup.adapters["r20"], (2, 0), r"rank 20 needs 3 pages"),
    ]
    for slot, adapter, pages, message in cases:
        with pytest.raises(PoolError, match=message):
            pool.fill(slot, adapter, pages)
        assert same(snapshot(pool), before) and pool.write_counts() == writes
        assert pool.occupant(0) == "r20" and pool.pages_of(0) == (0, 2, 4)
    small = PagedDevicePool(setup.targets, pages=4, page_rank=PAGE_RANK, max_rank=16, dtype=torch.float32)
    with pytest.raises(PoolError, match=r"adapter 'r20' into slot 0: rank 20 exceeds the pool's max rank 16"):
        small.fill(0, setup.adapters["r20"], (0, 1, 2))
    assert small.write_counts() == (0, 0, 0, 0) and small.live_slots() == frozenset()


def test_bytes_and_construction_refusals(setup: Setup) -> None:
    pool = PagedDevicePool(
        setup.targets, pages=3, page_rank=PAGE_RANK, max_rank=MAX_RANK, dtype=torch.float16
    )
    per_layer = (3 * 8 * 64 + 128 * 8) + (8 * 64 + 64 * 8) + (2 * 8 * 64 + 256 * 8) + (8 * 128 + 64 * 8)
    # Per group also its per-slot entries: ranks and scalings, a DoRA factor per output row and its flag.
    factors = (128 + 64 + 256 + 64) * 2 + 4 * 4
    assert pool.page_nbytes == 2 * (per_layer * 2 + (3 + 1 + 2 + 1) * 8 + factors)
    assert pool.nbytes == 3 * pool.page_nbytes and pool.pages == 3
    assert pool.device_nbytes(8) == pool.page_nbytes and pool.device_nbytes(20) == 3 * pool.page_nbytes
    assert PagedDevicePool.page_bytes(setup.targets, PAGE_RANK, torch.float16) == pool.page_nbytes
    with pytest.raises(
        PoolError, match=r"pages \(0\), page_rank \(8\) and max_rank \(24\) must all be positive"
    ):
        PagedDevicePool(setup.targets, pages=0, page_rank=PAGE_RANK, max_rank=MAX_RANK, dtype=torch.float16)
    with pytest.raises(PoolError, match="must be floating point"):
        PagedDevicePool(setup.targets, pages=2, page_rank=PAGE_RANK, max_rank=MAX_RANK, dtype=torch.int32)


def test_a_fill_that_fails_half_way_is_cleared_whole(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that raises after some groups were written (a device error, here injected) leaves entries
    set; the clear that follows (what the manager does) must zero all of them."""
    import lora_pin.weights.paged_pool as paged_pool

    pool = PagedDevicePool(
        setup.targets, pages=3, page_rank=PAGE_RANK, max_rank=MAX_RANK, dtype=torch.float32
    )
    real, calls = paged_pool.set_slot_meta, []

    def failing(*args: object, **kwargs: object) -> None:
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("injected device error")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_pool, "set_slot_meta", failing)
    with pytest.raises(RuntimeError, match="injected"):
        pool.fill(1, setup.adapters["r4"], (1,))
    assert any(pool.group_buffers(g.key).ranks[1].any() for g in pool.targets.groups)
    pool.clear(1)
    for g in pool.targets.groups:
        buf = pool.group_buffers(g.key)
        assert not buf.ranks[1].any() and not buf.scalings[1].any() and not buf.a[1].any(), g.key
    assert pool.live_slots() == frozenset() and pool.occupant(1) is None
