"""lora_pin inside transformers' continuous-batching engine, below HTTP: the order requests are admitted
in (pinned adapters' first, deferred ones within the age bound), and an engine that serves on after an
error inside a step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import LoRAManager, SpecError, _testing
from lora_pin.serve.engine import EngineConfig, EngineStats, LoRAEngine

POISON = 127
# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120


def _wait_for(condition: Callable[[], bool]) -> None:
    """Poll what the engine reports until ``condition`` holds; only a hang ends it otherwise."""
    _testing.wait_for("the engine", condition, HANG_GUARD_S, every=0.01)


def _submit_together(eng: LoRAEngine, requests: list[tuple[str, list[int], str | None, int]]) -> None:
    """Submit ``(id, prompt, adapter, max_new_tokens)`` requests while the engine's loop is paused, so
    its next round takes them all in at once: the order they are scheduled in is the scheduler's, never
    a race between this thread's submissions and the engine's steps."""
    with eng.cb.pause():
        for rid, prompt, adapter, tokens in requests:
            eng.submit(rid, prompt, adapter, max_new_tokens=tokens, streaming=False)


def _engine(
    tiny_llama_dir: Path,
    make_adapters: Any,
    tmp_path: Path,
    pinned: tuple[str, ...] = (),
    max_requests_per_batch: int | None = None,
) -> Iterator[LoRAEngine]:
    """Adapters a, b, c (``pinned`` ones pinned) over two slots, on a fresh copy of the tiny Llama."""
    from transformers import AutoModelForCausalLM

    dirs = make_adapters(
        tmp_path,
        {
            n: {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "seed": i}
            for i, n in enumerate("abc")
        },
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    manager = LoRAManager(model, [f"{n}={d}" for n, d in dirs.items()], max_loras_per_batch=2)
    for name in pinned:
        manager.pin(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EngineConfig(
        num_blocks=64, page_size=16, max_batch_tokens=256, max_requests_per_batch=max_requests_per_batch
    )
    eng = LoRAEngine(model, manager, config)
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()
        manager.detach()
        torch.set_num_threads(threads)


@pytest.fixture
def engine(tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path) -> Iterator[LoRAEngine]:
    """Three adapters over two slots."""
    yield from _engine(tiny_llama_dir, make_adapters, tmp_path)


@pytest.fixture
def narrow_engine(tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path) -> Iterator[LoRAEngine]:
    """Three adapters over two slots, ``a`` pinned, at most two requests a step: requests queue."""
    yield from _engine(tiny_llama_dir, make_adapters, tmp_path, pinned=("a",), max_requests_per_batch=2)


def _results(eng: LoRAEngine, ids: list[str], timeout: float = HANG_GUARD_S) -> dict[str, Any]:
    """Each request's finished output, and the order they finished in (``"order"``)."""
    results: dict[str, Any] = {"order": []}
    deadline = time.monotonic() + timeout
    while len(results) - 1 < len(ids) and time.monotonic() < deadline:
        output = eng.cb.get_result(timeout=0.5)
        if output is not None and output.is_finished():
            results[output.request_id] = output
            results["order"].append(output.request_id)
    assert len(results) - 1 == len(ids), f"only {results['order']} finished"
    return results


def test_a_deferred_request_waits_for_younger_resident_ones_at_most_overdue_after_rounds(
    narrow_engine: LoRAEngine,
) -> None:
    """Two requests a step, b holding the one free slot with a stream of younger b requests behind it:
    c1 needs the slot. The b requests cost no load and go first, but c1 is overdue after
    ``OVERDUE_AFTER`` rounds and goes first then, so it finishes before most of them (served strictly
    by cost, it would finish after all of them)."""
    order = ["b1", "c1", *(f"b{i}" for i in range(2, 10))]
    _submit_together(narrow_engine, [(rid, [5 + i, 40, 60, 70, 9], rid[0], 6) for i, rid in enumerate(order)])
    done = _results(narrow_engine, order)
    finished = done["order"]
    assert all(done[r].error is None for r in order)
    younger = order[order.index("c1") + 1 :]
    overtaken_by = [r for r in younger if finished.index(r) < finished.index("c1")]
    assert len(overtaken_by) <= len(younger) // 2, finished


def test_a_pinned_adapters_request_goes_before_older_ones_that_wait_for_a_slot(
    narrow_engine: LoRAEngine,
) -> None:
    """Two requests a step, one free slot, b and c requests queued (each waits for the slot, or for the
    step's room): a request for the pinned adapter a, submitted last, needs no slot and costs no load, so
    it starts in the next round and finishes before most of them (in arrival order it would be last)."""
    # a pinned adapter keeps the slot its first request brings it into: after a0 it needs no slot.
    narrow_engine.submit("a0", [8, 40, 60, 70, 9], "a", max_new_tokens=2, streaming=False)
    assert _results(narrow_engine, ["a0"])["a0"].error is None
    queued = [f"{n}{i}" for i in range(1, 5) for n in "bc"]
    # All in one round, a1 last: the engine finds the whole queue waiting, however fast or slow it is.
    _submit_together(
        narrow_engine,
        [
            *((rid, [5 + i, 40, 60, 70, 9], rid[0], 12) for i, rid in enumerate(queued)),
            ("a1", [9, 40, 60, 70, 9], "a", 6),
        ],
    )
    done = _results(narrow_engine, [*queued, "a1"])
    finished = done["order"]
    assert all(done[r].error is None for r in [*queued, "a1"])
    assert finished.index("a1") <= 3, finished


def test_a_cancelled_request_leaves_the_engine_wherever_it_was(narrow_engine: LoRAEngine) -> None:
    """Two requests a step: a running request and a waiting one are cancelled; both leave the engine
    without an output, the others finish whole, and once they are done the engine holds nothing.

    The first step's forward is held until both are cancelled: r0 runs in it (offered first), r5 waits
    (two a step, offered last), whatever the machine's speed."""
    engine = narrow_engine
    model = engine.cb.model
    in_forward, cancelled = threading.Event(), threading.Event()

    def hold_the_first_forward(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if not in_forward.is_set():
            in_forward.set()
            assert cancelled.wait(HANG_GUARD_S)

    hook = model.get_input_embeddings().register_forward_pre_hook(hold_the_first_forward)
    ids = [f"r{i}" for i in range(6)]
    try:
        _submit_together(
            engine, [(rid, [5 + i, 40, 60, 70, 9], "b" if i % 2 else None, 30) for i, rid in enumerate(ids)]
        )
        assert in_forward.wait(HANG_GUARD_S)
        held = engine.stats()
        assert held.running == 2 and held.queued == 4, held
        engine.cancel("r0")  # running: it was offered first
        engine.cancel("r5")  # waiting: two requests a step, and it is offered last
    finally:
        cancelled.set()
        hook.remove()
    kept = ["r1", "r2", "r3", "r4"]
    done = _results(engine, kept)
    assert all(done[r].error is None and len(done[r].generated_tokens) == 30 for r in kept)
    for rid in kept:
        engine.done(rid)
    # Once the engine holds nothing, no output can come any more: none of r0 or r5 came out.
    _wait_for(lambda: engine.stats() == EngineStats(0, 0, 0, 0))
    assert engine.cb.get_result(timeout=0.01) is None


def test_the_engine_serves_on_after_an_error_in_a_step(engine: LoRAEngine) -> None:
    """A forward that raises (a request carrying a token the model refuses) fails the requests of that
    step with the error; the engine's thread is started again and the next requests are served."""
    model = engine.cb.model

    def refuse(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if bool((args[0] == POISON).any()):
            raise RuntimeError("this model refuses token 127")

    hook = model.get_input_embeddings().register_forward_pre_hook(refuse)
    try:
        engine.submit("bad", [5, POISON, 9], "a", max_new_tokens=3, streaming=False)
        bad = _results(engine, ["bad"])["bad"]
        assert bad.error is not None and "refuses token 127" in bad.error
        # The supervisor saw the thread end and started it again (the old one may still be ending
        # when the error is delivered: is_alive() alone could see that one).
        _wait_for(lambda: engine.restarts == 1 and engine.is_alive())
        engine.submit("good", [5, 6, 9], "b", max_new_tokens=3, streaming=False)
        engine.submit("base", [5, 6, 9], None, max_new_tokens=3, streaming=False)
        done = _results(engine, ["good", "base"])
        assert done["good"].error is None and len(done["good"].generated_tokens) == 3
        assert done["base"].error is None
        assert engine.restarts == 1 and engine.is_alive()
    finally:
        hook.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mixed_batches_match_peft(tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path) -> None:
    """On CUDA the engine runs its forward on a stream of its own: lora_pin's slot copies and step arrays
    are queued there, so each request still gets its own adapter's tokens (as PEFT, greedy)."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dirs = make_adapters(
        tmp_path,
        {
            n: {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "seed": i}
            for i, n in enumerate("abc")
        },
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).to("cuda").eval()
    reference = copy.deepcopy(model)
    manager = LoRAManager(model, [f"{n}={d}" for n, d in dirs.items()], max_loras_per_batch=2)
    eng = LoRAEngine(model, manager, EngineConfig(num_blocks=64, page_size=16, max_batch_tokens=64))
    jobs = {
        f"r{i}": ([5 + i, 40 + i, 60, 70 + i, 9] * (1 + i % 3), [None, "a", "b", "c"][i % 4])
        for i in range(12)
    }
    eng.start()
    try:
        for rid, (prompt, adapter) in jobs.items():
            eng.submit(rid, prompt, adapter, max_new_tokens=8, streaming=False)
        done = _results(eng, list(jobs))
    finally:
        eng.stop()
        manager.detach()
    for rid, (prompt, adapter) in jobs.items():
        peft = (
            reference
            if adapter is None
            else PeftModel.from_pretrained(copy.deepcopy(reference), str(dirs[adapter]))
        )
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(peft(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
        assert done[rid].generated_tokens == ids[len(prompt) :], rid


@pytest.mark.parametrize("order", ["arrival", "longest_remaining"])
def test_a_paged_pool_serves_the_engines_steps_as_peft(
    tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path, order: str
) -> None:
    """The engine's steps (prepare_step, then run_subset on the requests it schedules) over a paged
    pool of ranks 4 to 64, fewer pages than the adapters need together, requests of 2 to 9 tokens, in
    each admission order (longest remaining first lets running requests sit out steps): each request's
    greedy tokens are PEFT's."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ranks = {"a": 4, "b": 8, "c": 16, "d": 64}
    dirs = make_adapters(
        tmp_path,
        {
            n: {"r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "seed": r}
            for n, r in ranks.items()
        },
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    reference = copy.deepcopy(model)
    items = [f"{n}={d}" for n, d in dirs.items()]
    probe = LoRAManager(copy.deepcopy(model), items, page_rank=8, max_lora_memory="64MiB")
    page_bytes = probe.stats()["page_bytes"]
    probe.detach()
    # 10 pages: "d" (8 pages) never fits beside all of the others (1 + 1 + 2).
    manager = LoRAManager(model, items, page_rank=8, max_lora_memory=10 * page_bytes)
    config = EngineConfig(num_blocks=64, page_size=16, max_batch_tokens=64)
    eng = LoRAEngine(model, manager, config, admission_order=order)
    jobs = {
        f"r{i}": (
            [5 + i, 40 + i, 60, 70 + i, 9] * (1 + i % 3),
            [None, "a", "b", "c", "d"][i % 5],
            2 + (i * 3) % 8,
        )
        for i in range(10)
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng.start()
    try:
        for rid, (prompt, adapter, tokens) in jobs.items():
            eng.submit(rid, prompt, adapter, max_new_tokens=tokens, streaming=False)
        done = _results(eng, list(jobs))
    finally:
        eng.stop()
        manager.detach()
        torch.set_num_threads(threads)
    assert manager.stats()["device"]["evictions"] > 0
    for rid, (prompt, adapter, tokens) in jobs.items():
        peft = (
            reference
            if adapter is None
            else PeftModel.from_pretrained(copy.deepcopy(reference), str(dirs[adapter]))
        )
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(tokens):
                ids.append(int(peft(torch.tensor([ids])).logits[0, -1].argmax()))
        assert done[rid].generated_tokens == ids[len(prompt) :], rid


def test_an_unknown_admission_order_is_refused_by_name(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with pytest.raises(SpecError, match="'shortest_first'"):
        LoRAEngine(model, None, admission_order="shortest_first")
