"""Background loading under tensor parallelism (gloo on CPU, TP = 2): reads that end at different times on
each rank are installed at the same step on every rank, so the ranks' steps and registries never part.

One rank's reads are slowed (or held) by ``lora_pin._testing.slow_store``; every step's admitted, deferred
and failed requests, and the registry's whole state after it, are gathered and compared across the ranks.
Two processes are spawned once and run every check (their start-up is most of the cost).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from lora_pin import LoRAManager
from lora_pin._testing import slow_store
from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.parallel import TensorParallel

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": {"r": 8, "lora_alpha": 16, "target_modules": ALL, "seed": 11},
    "b": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 12},
    "c": {"r": 2, "lora_alpha": 8, "target_modules": ["o_proj", "gate_proj", "up_proj"], "seed": 13},
    "d": {"r": 6, "lora_alpha": 12, "target_modules": ALL, "seed": 14},
}
# One request per entry, one token each: twelve requests over four adapters, with base rows.
REQUESTS = ["a", None, "b", "c", None, "d", "a", "c", "b", "d", None, "a"]
# The q_proj B row made NaN in "x": it lies in rank 1's shard at TP = 2 (rows 32..63 of 64).
NAN_KEY, NAN_ROW = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight", 60
# Steps a check runs at most before it calls the wait for reads a hang: each step sleeps 10 ms, so this
# gives the reads minutes however busy the machine (a step count, alike on every rank). The steps a check
# takes depend on when reads end; what every step does is compared, not how many there are.
MAX_STEPS = 12_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load(root: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "model").eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (len(REQUESTS), 1), generator=torch.Generator().manual_seed(21))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (4 heads, 1 kv head), the adapters above and the unsharded lora_pin logits of every
    request (each request is one token, so its logits do not depend on the step it runs in)."""
    root = tmp_path_factory.mktemp("tp_loading")
    make_tiny_llama(root / "model", heads=4, kv_heads=1, layers=2)
    for name, spec in ADAPTERS.items():
        make_peft_adapter(root / "model", root / name, **spec)
    model = _load(root)
    mgr = LoRAManager(model, [f"{n}={root / n}" for n in ADAPTERS], max_loras_per_batch=4, max_lora_rank=8)
    with torch.inference_mode(), mgr.batch(REQUESTS):
        want = model(_ids()).logits[:, -1]
    torch.save(want, root / "want.pt")
    return root


def _gathered(value: Any, tp: TensorParallel) -> list[Any]:
    found: list[Any] = [None] * tp.size
    dist.all_gather_object(found, value, group=tp.group)
    return found


def _same_on_every_rank(log: list[Any], tp: TensorParallel) -> None:
    """Every rank ran as many steps as this one, each alike (the first difference is reported)."""
    seen = _gathered(log, tp)
    for rank, other in enumerate(seen):
        for i, (mine, theirs) in enumerate(zip(seen[0], other, strict=False)):
            assert mine == theirs, f"step {i}: rank 0 ran {mine}, rank {rank} ran {theirs}"
        assert len(other) == len(seen[0]), f"rank 0 ran {len(seen[0])} steps, rank {rank} {len(other)}"


def _serve(
    mgr: LoRAManager, model: torch.nn.Module, queue: list[int], prefetch: bool = False
) -> tuple[list[Any], dict[int, torch.Tensor], dict[int, BaseException]]:
    """Run steps over ``queue`` (indices into REQUESTS), resubmitting what each step defers, until none
    is left: returns per step (admitted, deferred, failed, loading, registry state after it), the last
    logits of each admitted request, and the error of each failed one."""
    ids = _ids()
    log: list[Any] = []
    got: dict[int, torch.Tensor] = {}
    failed: dict[int, BaseException] = {}
    for _ in range(MAX_STEPS):
        if not queue:
            break
        names = [REQUESTS[i] if i < len(REQUESTS) else "x" for i in queue]
        if prefetch:
            mgr.prefetch(names)
        step = mgr.prepare_step(names, 1)
        try:
            rows = [queue[i] for i in step.admitted]
            if rows:
                with torch.inference_mode():
                    out = model(ids[[r % len(REQUESTS) for r in rows]]).logits[:, -1]
                got.update(zip(rows, out, strict=True))
        finally:
            mgr.finish(step)
        failed.update({queue[i]: e for i, e in step.failed.items()})
        mgr.registry.audit()
        state = mgr.registry.stats()
        log.append(
            (
                rows,
                [queue[i] for i in step.deferred],
                sorted(queue[i] for i in step.failed),
                [queue[i] for i in step.loading],
                state,
                sorted(mgr.host),
            )
        )
        queue = [queue[i] for i in step.deferred]
        time.sleep(0.01)
    assert not queue, "requests still waiting after every step"
    return log, got, failed


def _manager(model: torch.nn.Module, tp: TensorParallel, paths: dict[str, Path]) -> LoRAManager:
    """A manager whose host tier holds 2 adapters, 2 slots; ``paths`` registered in order (the first two
    at start-up, the rest loaded on every rank), so the earliest are back on disk."""
    items = list(paths.items())
    mgr = LoRAManager(
        model,
        [f"{n}={p}" for n, p in items[:2]],
        max_loras_per_batch=2,
        max_loaded_loras=2,
        max_lora_rank=8,
        lora_target_modules=ALL,
        tp=tp,
    )
    for name, path in items[2:]:
        mgr.load(name, path)
    return mgr


def _check_slow_rank(model: torch.nn.Module, root: Path, tp: TensorParallel) -> None:
    """Host tier of 2 adapters for a working set of 4, rank 1's reads 150 ms slower than rank 0's: every
    step admits, defers and fails the same requests on both ranks, the registries stay equal, and every
    request's logits equal the unsharded ones."""
    mgr = _manager(model, tp, {n: root / n for n in ADAPTERS})
    assert mgr.loading == "background"
    want = torch.load(root / "want.pt")
    with slow_store(150 if tp.rank == 1 else 0):
        log, got, failed = _serve(mgr, model, list(range(len(REQUESTS))), prefetch=True)
    _same_on_every_rank(log, tp)
    assert not failed
    assert any(loading for *_, loading, _, _ in log), "no request waited for a background read"
    for i in range(len(REQUESTS)):
        error = float((got[i] - want[i]).abs().max() / want[i].abs().max())
        assert error < 1e-5, (i, error)
    stats = mgr.stats()
    assert stats["background_loads"] > 0
    assert stats["tp_collective_calls"]["agree_fetches"] > 0
    # Each agreement moves one int64 per open fetch and rank.
    assert stats["tp_collective_bytes"]["agree_fetches"] % (8 * tp.size) == 0
    # batch() waits for its reads in rounds, each ending in an agreement: as many rounds on every rank.
    # Two adapters out of host memory (the registries agree, so the same two on every rank).
    outside = [n for n in ADAPTERS if n not in mgr.host][:2]
    assert len(outside) == 2
    rows = [REQUESTS.index(n) for n in outside]
    with (
        slow_store(150 if tp.rank == 1 else 0),
        torch.inference_mode(),
        mgr.batch([REQUESTS[i] for i in rows]),
    ):
        out = model(_ids()[rows]).logits[:, -1]
    assert float((out - want[rows]).abs().max() / want[rows].abs().max()) < 1e-5
    calls = mgr.stats()["tp_collective_calls"]
    _same_on_every_rank([calls, mgr.registry.stats()], tp)
    assert calls["agree_fetches"] > stats["tp_collective_calls"]["agree_fetches"]
    mgr.detach()


def _check_read_failing_on_one_rank(model: torch.nn.Module, root: Path, tp: TensorParallel) -> None:
    """A background read that fails on rank 1 only (a NaN in its shard) while rank 0's read is still held:
    its requests fail at the same step on both ranks with AdapterLoadError, nothing is installed, and
    once the file is good again the adapter is read and served."""
    folder = root / "x"
    weights = folder / "adapter_model.safetensors"
    if tp.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(root / "b", folder)
    dist.barrier(group=tp.group)
    mgr = _manager(model, tp, {"x": folder, "a": root / "a", "c": root / "c"})
    assert "x" not in mgr.host  # evicted by the later registrations
    good = load_file(weights) if tp.rank == 0 else {}
    if tp.rank == 0:
        bad = dict(good)
        bad[NAN_KEY] = good[NAN_KEY].clone()
        bad[NAN_KEY][NAN_ROW, 0] = float("nan")
        save_file(bad, weights)
    dist.barrier(group=tp.group)
    x = len(REQUESTS)  # request index of the one request for "x"
    with slow_store(gated=tp.rank == 0) as store:
        log, _, failed = _serve(mgr, model, [1, 0, x])
        if tp.rank == 0:
            # Queued or running, it counted as running in every agreement; it is held, so it begins.
            assert store.wait_for_read("x"), "rank 0 never began its read"
    _same_on_every_rank(log, tp)
    assert list(failed) == [x]
    assert isinstance(failed[x], AdapterLoadError)
    assert ("NaN" if tp.rank == 1 else "failed on rank(s) [1]") in str(failed[x])
    assert log[-1][0] == [], "the step that failed x admitted nothing: 0 and 1 ran before"
    # Nothing half-installed: x holds no host memory, no reservation, no slot on either rank.
    assert mgr.wait_loads(timeout=30)
    state = mgr.registry.stats()
    assert "x" not in mgr.host and state["fetching"] == 0 and state["host"]["reserved_bytes"] == 0
    assert mgr.residency.host_bytes == sum(mgr.host[n].nbytes for n in mgr.host)
    assert all(mgr.pool.occupant(s) != "x" for s in range(mgr.pool.slots))
    dist.barrier(group=tp.group)
    if tp.rank == 0:
        save_file(good, weights)
    dist.barrier(group=tp.group)
    log, got, failed = _serve(mgr, model, [x])
    _same_on_every_rank(log, tp)
    assert not failed and x in got and "x" in mgr.host
    mgr.detach()


def _check_unload_while_fetching(model: torch.nn.Module, root: Path, tp: TensorParallel) -> None:
    """An adapter unloaded (on every rank) while it is being fetched, its read over on rank 0 and held on
    rank 1: it stays fetching on both until then, the reads' results are dropped on both ranks, the
    registries stay equal, and the name can be loaded and served again."""
    mgr = _manager(model, tp, {n: root / n for n in ADAPTERS})
    assert "a" not in mgr.host
    with slow_store(gated=tp.rank == 1) as store:
        step = mgr.prepare_step(["a", None], 1)
        mgr.finish(step)
        assert step.loading == (0,)
        if tp.rank == 0:
            assert mgr.wait_loads(timeout=30)
        else:
            assert store.wait_for_read("a")
        step = mgr.prepare_step([None, "d"], 1)
        mgr.finish(step)
        state = mgr.registry.stats()
        _same_on_every_rank([(state, sorted(mgr.host))], tp)
        assert state["host"]["fetching"] == ["a"] and "a" not in mgr.host
        mgr.unload("a")
    assert mgr.wait_loads(timeout=30)
    step = mgr.prepare_step([None, "d"], 1)
    mgr.finish(step)
    state = mgr.registry.stats()
    _same_on_every_rank([(state, sorted(mgr.host))], tp)
    assert "a" not in mgr.registry and "a" not in mgr.host
    assert state["fetching"] == 0 and state["host"]["reserved_bytes"] == 0
    assert mgr.residency.host_bytes == sum(mgr.host[n].nbytes for n in mgr.host)
    mgr.load("a", root / "a")
    _, got, failed = _serve(mgr, model, [0])
    assert not failed and 0 in got
    mgr.detach()


def _worker(rank: int, world: int, root_text: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    # A collective one rank never joins (ranks that parted) fails the test instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    try:
        from lora_pin.parallel_fixtures import shard_llama

        root = Path(root_text)
        tp = TensorParallel(rank, world)
        model = shard_llama(_load(root), tp)
        _check_slow_rank(model, root, tp)
        _check_read_failing_on_one_rank(model, root, tp)
        _check_unload_while_fetching(model, root, tp)
    finally:
        dist.destroy_process_group()


def test_background_loading_at_tp_2_agrees_on_every_install(root: Path) -> None:
    mp.spawn(_worker, args=(2, str(root), _free_port()), nprocs=2, join=True)
