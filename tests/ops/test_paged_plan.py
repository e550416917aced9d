"""The paged kernels fed by the core's own plans: a rank-paged LoRARegistry (ranks 4..64, one pin,
churn through evictions) plans each step; the pool's pages are written from the plan's page tables
(every other page NaN) and the paged shrink/expand, torch and Triton (interpreter), must equal a plain
float64 per-token LoRA from each adapter's own weights. This checks that the kernels read
``page_indptr`` / ``page_table`` / ``slot_ranks`` exactly as the planner writes them."""

from __future__ import annotations

import array
import random

import pytest
import torch

from lora_pin._core import LoRARef, LoRARegistry
from lora_pin.ops import segments_from_slots
from lora_pin.ops.paged import PageTable
from lora_pin.ops.paged_torch import paged_expand_torch, paged_shrink_torch

PAGE_RANK, PAGES, MAX_RANK, IN, OUT = 8, 16, 64, 32, 24
RANKS = [4, 8, 12, 16, 24, 32, 64, 5]


def _ints(buf: bytearray) -> torch.Tensor:
    return torch.tensor(array.array("i", bytes(buf)).tolist(), dtype=torch.int32)


def _floats(buf: bytearray) -> torch.Tensor:
    return torch.tensor(array.array("f", bytes(buf)).tolist(), dtype=torch.float32)


def _implementations() -> list[object]:
    impls: list[object] = ["torch"]
    try:
        import lora_pin.ops.triton_paged  # noqa: F401
    except ImportError:
        impls.append(pytest.param("triton", marks=pytest.mark.skip(reason="no triton")))
    else:
        impls.append(pytest.param("triton", marks=pytest.mark.triton))
    return impls


def _shrink_expand(impl: str, x, a_pages, b_pages, pages, meta, out) -> None:
    if impl == "torch":
        paged_expand_torch(out, paged_shrink_torch(x, a_pages, pages, meta, MAX_RANK), b_pages, pages, meta)
    else:
        from lora_pin.ops import triton_paged

        v = triton_paged.paged_shrink(x, a_pages, pages, meta, MAX_RANK)
        triton_paged.paged_expand(out, v, b_pages, pages, meta)


@pytest.mark.parametrize("impl", _implementations())
def test_the_kernels_read_the_planners_page_tables(impl):
    gen = torch.Generator().manual_seed(37)
    rng = random.Random(37)
    weights = [
        (torch.randn(r, IN, generator=gen) / IN**0.5, torch.randn(OUT, r, generator=gen) / r**0.5)
        for r in RANKS
    ]
    scalings = [0.5 + i / 4 for i in range(len(RANKS))]
    reg = LoRARegistry(None, page_rank=PAGE_RANK, max_lora_memory=PAGES)
    for i, rank in enumerate(RANKS):
        reg.register(
            LoRARef(f"a{i}", f"/srv/a{i}"), rank=rank, host_bytes=1, device_bytes=1, scaling=scalings[i]
        )
    reg.pin("a3")
    checked = set()
    for _ in range(12):
        names = [rng.choice([None, *range(len(RANKS))]) for _ in range(rng.randint(2, 6))]
        plan = reg.begin_step([None if n is None else f"a{n}" for n in names], 1)
        for index in range(len(plan.loads)):
            reg.report_load(plan.ticket, index, True)  # type: ignore[arg-type]
        admitted = [names[r] for r in plan.admitted]
        request_slots = _ints(plan.request_slots)
        page_indptr, page_table = _ints(plan.page_indptr), _ints(plan.page_table)
        slot_ranks = _ints(plan.slot_ranks).view(-1, 1)
        slot_scalings = _floats(plan.slot_scalings).view(-1, 1)
        # The pool as the loader would leave it: each admitted adapter's ranks in its pages, the rest NaN.
        a_pages = torch.full((PAGES, PAGE_RANK, IN), float("nan"))
        b_pages = torch.full((PAGES, OUT, PAGE_RANK), float("nan"))
        for adapter, slot in zip(admitted, request_slots.tolist(), strict=True):
            if adapter is None:
                continue
            a, b = weights[adapter]
            own = page_table[page_indptr[slot] : page_indptr[slot + 1]].tolist()
            assert len(own) == -(-RANKS[adapter] // PAGE_RANK)
            for j, page in enumerate(own):
                lo, hi = j * PAGE_RANK, min((j + 1) * PAGE_RANK, RANKS[adapter])
                a_pages[page].zero_()
                b_pages[page].zero_()
                a_pages[page, : hi - lo] = a[lo:hi]
                b_pages[page, :, : hi - lo] = b[:, lo:hi]
            checked.add(adapter)
        tokens = 3
        token_slots = torch.repeat_interleave(request_slots.long(), tokens)
        x = torch.randn(token_slots.shape[0], IN, generator=gen)
        out = torch.randn(token_slots.shape[0], OUT, generator=gen)
        meta = segments_from_slots(token_slots, 2).for_layer(slot_ranks, slot_scalings, [0, OUT])
        got = out.clone()
        _shrink_expand(impl, x, a_pages, b_pages, PageTable(page_indptr, page_table, PAGE_RANK), meta, got)
        want = out.double().clone()
        for t, adapter in enumerate(a for a in admitted for _ in range(tokens)):
            if adapter is not None:
                a, b = weights[adapter]
                want[t] += scalings[adapter] * (b.double() @ (a.double() @ x[t].double()))
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
        reg.finish_step(plan.ticket)  # type: ignore[arg-type]
    assert checked == set(range(len(RANKS))), "every adapter should have been served at least once"
    assert reg.stats()["device"]["evictions"] > 0, "the run should churn"
