"""LoRAManager over a paged device pool (``page_rank`` / ``max_lora_memory``), against PEFT as the oracle:
mixed batches of ranks 4 to 64 (DoRA among them) with a pin and churn equal PEFT's
``model(..., adapter_names=[...])`` row by row on every backend path, base rows bit for bit; the same
bytes hold more adapters per step than slots; the budget and what cannot be paged are refused by name;
and a page table read shifted by one page fails the oracle check (so that check can fail)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import lora_pin.model.attach as attach_module
from lora_pin import LoRAManager, PoolError, SpecError
from lora_pin.model.layers import LoRALinear
from lora_pin.model.segments import DevicePages
from lora_pin.ops.backends import CudaBackend, TorchOpsBackend, cpu_paged
from lora_pin.ops.paged import PageTable

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAGE_RANK = 8
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (6e-2, 6e-2)}
ADAPTERS: dict[str, dict[str, Any]] = {
    "a4": dict(r=4, lora_alpha=8, target_modules=ALL, seed=1),
    "b4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], seed=2),
    "a8": dict(r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"v_proj": 3}, seed=3),
    "b8": dict(r=8, lora_alpha=8, target_modules=ALL, use_rslora=True, seed=4),
    "a16": dict(r=16, lora_alpha=16, target_modules=ALL, seed=5),
    "d16": dict(r=16, lora_alpha=32, target_modules=ALL, use_dora=True, seed=6),
    "a64": dict(r=64, lora_alpha=64, target_modules=ALL, seed=7),
    "b64": dict(r=64, lora_alpha=32, target_modules=ALL, layers_to_transform=[1], seed=8),
}
# With "a8" pinned (1 page) in 12 pages: each round fits, and the rounds force evictions between steps.
ROUNDS: list[list[str | None]] = [
    ["a4", None, "a16", "b8", "a8", "d16"],
    ["a64", "b4", None, "a8"],
    ["b64", "a16", "a8"],
    ["a64", "d16", "a4", None],
    ["b8", "a8", "b4", "a16", "a4", "d16", "b8"],
    ["b64", None, "b4"],
]


@dataclass
class World:
    adapters: dict[str, Path]
    peft: Any
    base: Any


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: Path,
    make_adapters: Callable[..., dict[str, Path]],
) -> World:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapters = make_adapters(tmp_path_factory.mktemp("paged"), ADAPTERS)
    names = list(adapters)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir), adapters[names[0]], adapter_name=names[0]
    )
    for n in names[1:]:
        peft.load_adapter(adapters[n], adapter_name=n)
    peft.eval()
    return World(adapters, peft, AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval())


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def startup(world: World, pinned: tuple[str, ...] = ()) -> list[Any]:
    return [
        {"lora_name": n, "lora_path": str(p), "pinned": True} if n in pinned else f"{n}={p}"
        for n, p in world.adapters.items()
    ]


def peft_logits(peft: Any, ids: torch.Tensor, names: list[str | None]) -> torch.Tensor:
    """PEFT's logits, row i with adapter ``names[i]``: one mixed batch (``adapter_names``) for the plain
    adapters; DoRA rows, which PEFT's mixed batches refuse, each with its adapter set on the whole batch."""
    dora = {n for n in names if n is not None and ADAPTERS[n].get("use_dora")}
    want = peft(
        ids, adapter_names=[n if n is not None and n not in dora else "__base__" for n in names]
    ).logits
    for name in dora:
        peft.base_model.set_adapter(name)
        rows = [i for i, n in enumerate(names) if n == name]
        want[rows] = peft(ids).logits[rows]
    return want


def page_bytes(world: World, dtype: torch.dtype) -> int:
    """One page's bytes for the world's targets, as the manager reports it."""
    probe = LoRAManager(
        copy.deepcopy(world.base).to(dtype),
        startup(world)[:1],
        page_rank=PAGE_RANK,
        max_lora_memory=1 << 30,
        max_lora_rank=64,
    )
    size = probe.stats()["page_bytes"]
    probe.detach()
    assert isinstance(size, int)
    return size


def serve_rounds(
    world: World,
    dtype: torch.dtype,
    rounds: list[list[str | None]] = ROUNDS,
    pages: int = 12,
    device: str = "cpu",
) -> tuple[LoRAManager, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str | None]]]]:
    """Serve ``rounds`` on a fresh model over ``pages`` pages with "a8" pinned; per round the manager's
    logits, PEFT's (in ``dtype``) and the base model's."""
    base = copy.deepcopy(world.base).to(device, dtype)
    moved = dtype != torch.float32 or device != "cpu"
    peft = copy.deepcopy(world.peft).to(device, dtype) if moved else world.peft
    model = copy.deepcopy(base)
    mgr = LoRAManager(
        model,
        startup(world, pinned=("a8",)),
        page_rank=PAGE_RANK,
        max_lora_memory=pages * page_bytes(world, dtype),
        max_lora_rank=64,
    )
    assert mgr.pool.pages == pages and mgr.registry.max_lora_memory == pages
    results = []
    for seed, names in enumerate(rounds):
        ids = tokens(len(names), 5, seed).to(device)
        with torch.no_grad():
            with mgr.batch(names):
                got = model(ids).logits
            want = peft_logits(peft, ids, names)
            plain = base(ids).logits
        results.append((got, want, plain, names))
    return mgr, results


def assert_rows(got: torch.Tensor, want: torch.Tensor, plain: torch.Tensor, names: list[str | None]) -> None:
    rtol, atol = TOLERANCE[got.dtype]
    for i, name in enumerate(names):
        if name is None:
            assert torch.equal(got[i], plain[i]), f"base row {i} was touched"
        else:
            torch.testing.assert_close(
                got[i], want[i], rtol=rtol, atol=atol, msg=lambda m, i=i: f"row {i}: {m}"
            )
            assert not torch.equal(got[i], plain[i]), f"row {i}: the adapter changed nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_ranks_with_a_pin_and_churn_equal_peft(world: World, dtype: torch.dtype) -> None:
    mgr, results = serve_rounds(world, dtype)
    for got, want, plain, names in results:
        assert_rows(got, want, plain, names)
    stats = mgr.stats()
    device = stats["device"]
    assert device["evictions"] >= 3 and device["max_pages"] == 12, device
    assert device["pinned"] == ["a8"] and not any(k.startswith("a8/") for k in stats["evictions_by_adapter"])
    # The pool's own record agrees with the core's: each adapter in the device tier fills its slot, with
    # the pages its rank needs, and no two share a page.
    placement = mgr.registry.placement()
    held: list[int] = []
    for name, _id, _serial, tier, slot, *_ in placement["adapters"]:
        if tier == "device":
            pages = mgr.pool.pages_of(slot)
            assert mgr.pool.occupant(slot) == name and len(pages) == -(-ADAPTERS[name]["r"] // PAGE_RANK)
            held += pages
    assert len(held) == len(set(held)) == device["pages"] and placement["free_slots"] == 12 - len(held)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pages_equal_peft(world: World) -> None:
    """The CUDA backend's Triton paged kernels, the pool's side-stream copies into pages and the page
    tables uploaded per step, through the same churn."""
    mgr, results = serve_rounds(world, torch.bfloat16, device="cuda")
    assert mgr.pool.device.type == "cuda"
    for got, want, plain, names in results:
        assert_rows(got, want, plain, names)


@pytest.mark.parametrize("backend", ["torch_ops", pytest.param("triton", marks=pytest.mark.triton)])
def test_the_other_backends_equal_peft_on_pages(
    world: World, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registered-ops backend (what other devices and torch.compile run) and the CUDA backend's
    Triton paged kernels (here under the interpreter, on CPU tensors) over the same pages."""
    if backend == "triton":
        pytest.importorskip("lora_pin.ops.triton_paged")
    made = TorchOpsBackend() if backend == "torch_ops" else CudaBackend()
    monkeypatch.setattr(attach_module, "backend_for", lambda device: made)
    _, results = serve_rounds(world, torch.float32, ROUNDS[:2])
    for got, want, plain, names in results:
        assert_rows(got, want, plain, names)


def test_a_shifted_page_table_fails_the_peft_check(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle check is sharp: the same rounds read through each slot's page table rotated by one
    entry (every adapter's ranks read from a neighbour's pages) no longer equal PEFT."""
    original = DevicePages.of

    def shifted(self: DevicePages, indptr: bytes, table: bytes) -> PageTable:
        pages = original(self, indptr, table)
        return pages._replace(page_table=pages.page_table.roll(1))

    monkeypatch.setattr(DevicePages, "of", shifted)
    _, results = serve_rounds(world, torch.float32, ROUNDS[:1])
    got, want, _, names = results[0]
    rows = [i for i, n in enumerate(names) if n is not None]
    assert not torch.allclose(got[rows], want[rows], rtol=1e-2, atol=1e-2)


def test_pages_hold_more_rank8_adapters_per_step_than_slots_at_equal_bytes(
    world: World, tmp_path: Path, make_adapters: Callable[..., dict[str, Path]]
) -> None:
    specs = {f"r8_{i}": dict(r=8, lora_alpha=16, target_modules=ALL, seed=20 + i) for i in range(10)}
    adapters = make_adapters(tmp_path, specs)
    items = [f"{n}={p}" for n, p in adapters.items()]
    names: list[str | None] = [*adapters, None]
    slots = LoRAManager(copy.deepcopy(world.base), items, max_loras_per_batch=2, max_lora_rank=64)
    budget = slots.stats()["pool_bytes"]
    paged = LoRAManager(
        copy.deepcopy(world.base), items, page_rank=PAGE_RANK, max_lora_memory=budget, max_lora_rank=64
    )
    assert paged.stats()["pool_bytes"] <= budget
    held = {}
    for label, mgr in (("slots", slots), ("pages", paged)):
        step = mgr.prepare_step(names, 3)
        held[label] = [names[i] for i in step.admitted if names[i] is not None]
        mgr.finish(step)
    assert len(held["slots"]) == 2 and len(held["pages"]) == 10, held
    device = paged.stats()["device"]
    assert len(device["resident"]) == 10 and device["pages"] == 10 and device["max_pages"] >= 12, device


def test_the_budget_and_the_paging_arguments_are_checked(world: World) -> None:
    size = page_bytes(world, torch.float32)

    def make(**kwargs: Any) -> LoRAManager:
        return LoRAManager(copy.deepcopy(world.base), startup(world)[:2], max_lora_rank=64, **kwargs)

    with pytest.raises(
        SpecError, match=r"holds 7 page\(s\) of \d+ bytes .* an adapter of the pool's rank 64 needs 8"
    ):
        make(page_rank=PAGE_RANK, max_lora_memory=8 * size - 1)
    with pytest.raises(SpecError, match="page_rank and max_lora_memory go together"):
        make(page_rank=PAGE_RANK)
    with pytest.raises(SpecError, match="page_rank and max_lora_memory go together"):
        make(max_lora_memory="1GiB")
    with pytest.raises(SpecError, match="page_rank must be an int of at least 1"):
        make(page_rank=0, max_lora_memory="1GiB")
    with pytest.raises(SpecError, match=r"max_lora_memory must be bytes: .* \(got '12 parsecs'\)"):
        make(page_rank=PAGE_RANK, max_lora_memory="12 parsecs")
    with pytest.raises(SpecError, match=r"holds 65537 pages of \d+ bytes, past the 65536 a pool may have"):
        make(page_rank=PAGE_RANK, max_lora_memory=65537 * size)
    exact = make(page_rank=PAGE_RANK, max_lora_memory=8 * size)
    assert exact.pool.pages == 8 and exact.registry.max_loras_per_batch == 8
    text = make(page_rank=PAGE_RANK, max_lora_memory="4MiB", max_loras_per_batch=3)
    assert text.pool.pages == (4 << 20) // size and text.registry.max_loras_per_batch == 3


def test_targets_that_cannot_be_paged_are_refused_by_name(world: World) -> None:
    with pytest.raises(PoolError, match=r"target 'model.embed_tokens' cannot be paged: an embedding's A"):
        LoRAManager(
            copy.deepcopy(world.base),
            lora_target_modules=["embed_tokens", "q_proj"],
            max_lora_rank=8,
            page_rank=PAGE_RANK,
            max_lora_memory="64MiB",
        )


def test_slots_the_core_freed_without_reuse_read_as_empty(world: World) -> None:
    """Evictions that free more pages than the load takes leave some evicted adapters' first pages free:
    their slots must read as rank 0 (the paged kernels check every slot's rank against its pages)."""
    rounds: list[list[str | None]] = [["a8", "a64"], ["a16"], ["b4"], ["a64"], ["b64", None], ["a4", "a8"]]
    mgr, results = serve_rounds(world, torch.float32, rounds)
    for got, want, plain, names in results:
        assert_rows(got, want, plain, names)
    resident = {slot for _, _, _, tier, slot, *_ in mgr.registry.placement()["adapters"] if tier == "device"}
    assert mgr.pool.live_slots() == resident


def test_replacing_with_another_rank_and_unloading_keep_pages_right(world: World) -> None:
    """A replacement whose rank needs more pages moves the adapter to new pages; an unload frees its
    pages: each later step still equals PEFT and the pool holds exactly the core's resident slots."""
    model = copy.deepcopy(world.base)
    mgr = LoRAManager(
        model,
        [f"z={world.adapters['a4']}", f"b8={world.adapters['b8']}"],
        page_rank=PAGE_RANK,
        max_lora_memory=12 * page_bytes(world, torch.float32),
        max_lora_rank=64,
    )
    ids = tokens(3, 4, 7)

    def check(names: list[str | None], as_peft: list[str | None]) -> None:
        with torch.no_grad():
            with mgr.batch(names):
                got = model(ids).logits
            want = peft_logits(world.peft, ids, as_peft)
            plain = world.base(ids).logits
        assert_rows(got, want, plain, as_peft)
        resident = {
            slot for _, _, _, tier, slot, *_ in mgr.registry.placement()["adapters"] if tier == "device"
        }
        assert mgr.pool.live_slots() == resident

    check(["z", None, "b8"], ["a4", None, "b8"])
    mgr.load("z", world.adapters["a16"], replace=True)
    check(["z", "b8", None], ["a16", "b8", None])
    mgr.unload("b8")
    mgr.load("b8", world.adapters["a64"])
    check(["b8", "z", None], ["a64", "a16", None])


def test_lm_head_pages_like_a_linear(world: World, tmp_path: Path) -> None:
    """The output layer is a linear target: its adapters page and equal PEFT (only embeddings are
    refused)."""
    from peft import PeftModel

    from lora_pin.fixtures import make_peft_adapter

    adapters = {
        n: make_peft_adapter(
            world.base, tmp_path / n, r=r, lora_alpha=8, target_modules=["lm_head", "q_proj"], seed=r
        )
        for n, r in (("h4", 4), ("h12", 12))
    }
    peft = PeftModel.from_pretrained(copy.deepcopy(world.base), adapters["h4"], adapter_name="h4")
    peft.load_adapter(adapters["h12"], adapter_name="h12")
    model = copy.deepcopy(world.base)
    mgr = LoRAManager(
        model, [f"{n}={p}" for n, p in adapters.items()], page_rank=PAGE_RANK, max_lora_memory="1MiB"
    )
    assert "lm_head" in mgr.targets.module_names
    names: list[str | None] = ["h4", None, "h12"]
    ids = tokens(3, 5, 3)
    with torch.no_grad():
        with mgr.batch(names):
            got = model(ids).logits
        want = peft.eval()(ids, adapter_names=[n or "__base__" for n in names]).logits
        plain = world.base(ids).logits
    assert_rows(got, want, plain, names)


def test_a_step_plans_once_and_reads_an_adapter_moved_into_other_pages(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a step's layer groups are planned on their first forward (a plan looked up per
    distinct ranks, shared between groups) and a second forward of the step looks none up; after "a64"
    evicts one of the adapters and "b4" takes its page, that adapter comes back into another page, and a
    step of the same rows plans anew from its own arrays and page tables and still equals PEFT (a step
    that ran the first step's plans fails it)."""
    looked_up = [0]
    lookup = cpu_paged.plan_for

    def counted(*args: Any, **kwargs: Any) -> Any:
        looked_up[0] += 1
        return lookup(*args, **kwargs)

    monkeypatch.setattr(cpu_paged, "plan_for", counted)
    model = copy.deepcopy(world.base)
    mgr = LoRAManager(
        model,
        [f"{n}={world.adapters[n]}" for n in ("a4", "b8", "a64", "b4")],
        page_rank=PAGE_RANK,
        max_lora_memory=9 * page_bytes(world, torch.float32),
        max_lora_rank=64,
    )
    groups = sum(isinstance(m, LoRALinear) for m in model.modules())

    def held() -> dict[str, tuple[int, ...]]:
        placement = mgr.registry.placement()["adapters"]
        return {name: mgr.pool.pages_of(slot) for name, _, _, tier, slot, *_ in placement if tier == "device"}

    names: list[str | None] = ["a4", None, "b8"]
    ids = tokens(3, 5, 11)
    with torch.no_grad():
        with mgr.batch(names):
            first = model(ids).logits
            planned = looked_up[0]
            again = model(ids).logits
        assert looked_up[0] == planned and 0 < planned < groups, (planned, groups)
        before = held()
        for churn in ("a64", "b4"):
            with mgr.batch([churn, None, None]):
                model(tokens(3, 5, 12))
        with mgr.batch(names):
            moved = model(ids).logits
        after = held()
        want = peft_logits(world.peft, ids, names)
        plain = world.base(ids).logits
    assert torch.equal(again, first)
    assert any(after[n] != before[n] for n in ("a4", "b8")), (before, after)
    assert_rows(first, want, plain, names)
    assert_rows(moved, want, plain, names)
