"""The seams of transformers' continuous-batching engine that ``lora_pin.serve`` builds on.

Its internals change almost every release; the ``serve`` extra pins the minor version, and this file
fails when an upgrade removes or changes any seam the integration uses, so the upgrade fails in CI and
not at a user's. Each check names the seam and where lora_pin uses it.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from pathlib import Path
from typing import Any

import pytest

from lora_pin import LoRAManager
from lora_pin.serve.engine import EngineConfig, LoRAEngine

cb = pytest.importorskip("transformers.generation.continuous_batching")

# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120


def _params(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_scheduler_registry_and_the_hooks_the_lora_scheduler_overrides() -> None:
    from transformers.generation.continuous_batching.scheduler import (
        SCHEDULER_MAPPING,
        FIFOScheduler,
        Scheduler,
    )

    # engine.py registers its scheduler here, chosen by ContinuousBatchingConfig.scheduler_type.
    assert SCHEDULER_MAPPING["fifo"] is FIFOScheduler and issubclass(FIFOScheduler, Scheduler)
    # Overridden: admission in front of the engine's budgets; the end of the last step.
    assert _params(Scheduler._process_candidates) == [
        "self",
        "candidates",
        "token_budget",
        "cache_budget",
        "request_ids_to_remove_from_waiting",
    ]
    assert _params(Scheduler.clear_cancelled_requests) == ["self"]
    assert _params(Scheduler.finish_request) == ["self", "request_id"]
    # Cancellation: the engine marks a cancelled request it holds, which the removal that follows drops;
    # it counts the requests taken in (every one enters through add_waiting_request) and those held.
    assert _params(Scheduler.set_request_cancellation) == ["self", "request_id"]
    assert _params(Scheduler.add_waiting_request) == ["self", "state"]
    assert "_requests_to_cancel" in inspect.getsource(Scheduler.clear_cancelled_requests)
    assert "add_waiting_request" in inspect.getsource(
        cb.continuous_api.ContinuousBatchProcessor._update_tp_group_state
    )
    reset = inspect.getsource(Scheduler.reset)
    assert "self.active_requests" in reset and "self.waiting_requests" in reset
    # clear_cancelled_requests runs first in every round of the loop, after the last step's update.
    source = inspect.getsource(cb.continuous_api.ContinuousBatchProcessor.prepare_next_batch)
    assert source.index("clear_cancelled_requests") < source.index("schedule_batch")
    assert "waiting_requests" in inspect.getsource(Scheduler.reset)


def test_the_forward_runs_on_the_engines_compute_stream() -> None:
    """engine.py queues the manager's copies and step arrays on the stream the forward runs on."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    assert "self.compute_stream" in inspect.getsource(ContinuousBatchingIOs.__init__)
    assert "stream_context(compute_stream)" in inspect.getsource(ModelRunner.compute_batch)
    assert "self.inputs_and_outputs" in inspect.getsource(cb.continuous_api.ContinuousBatchProcessor.__init__)
    assert "self.batch_processor = batch_processor" in inspect.getsource(
        cb.ContinuousBatchingManager._run_generation_loop
    )
    # engine.stats() reads the scheduler's queues through the batch processor.
    assert "self.scheduler = scheduler" in inspect.getsource(
        cb.continuous_api.ContinuousBatchProcessor.__init__
    )


def test_the_request_states_fields_and_the_output_router() -> None:
    from transformers.generation.continuous_batching.requests import (
        FutureRequestState,
        GenerationOutput,
        RequestState,
        RequestStatus,
    )

    fields = {f.name for f in dataclasses.fields(RequestState)}
    assert {"request_id", "remaining_prefill_tokens", "initial_tokens", "generated_tokens"} <= fields
    # The longest-remaining admission order reads a request's limit and what it generated.
    assert "max_new_tokens" in fields and _params(RequestState.generated_len) == ["self"]
    state = RequestState(request_id="r", initial_tokens=[1, 2], max_new_tokens=5)
    state.generated_tokens.extend([7, 8])
    assert (state.max_new_tokens, state.generated_len()) == (5, 2)
    assert isinstance(RequestState.status, property)
    assert {"PENDING", "DECODING"} <= set(RequestStatus.__members__)
    assert {"state", "query_length"} <= set(FutureRequestState.__slots__)
    outputs = {f.name for f in dataclasses.fields(GenerationOutput)}
    assert {"request_id", "generated_tokens", "error", "timestamps"} <= outputs
    assert callable(GenerationOutput.is_finished)
    assert _params(cb.continuous_api.OutputRouter.fail_and_deliver) == ["self", "state", "error"]
    # engine.py counts and removes per-request handlers; a request without one goes to the shared queue.
    assert "self.result_handlers" in inspect.getsource(cb.continuous_api.OutputRouter.__init__)
    assert "self.output_queue.put" in inspect.getsource(cb.continuous_api.OutputRouter.deliver)


def test_the_managers_entry_points() -> None:
    manager = cb.ContinuousBatchingManager
    add = inspect.signature(manager.add_request).parameters
    assert {"input_ids", "request_id", "max_new_tokens", "streaming", "record_timestamps"} <= set(add)
    assert _params(manager.register_result_handler) == ["self", "request_id", "callback"]
    assert _params(manager.cancel_request) == ["self", "request_id"]
    assert {"block", "timeout", "hard_stop"} <= set(_params(manager.stop))
    for name in ("start", "is_running", "get_result"):
        assert callable(getattr(manager, name))
    # The tests submit a burst inside a pause of the loop, which its next round drains in one go.
    assert callable(manager.pause)
    assert "drain_queue(self.input_queue)" in inspect.getsource(
        cb.continuous_api.ContinuousBatchProcessor._update_tp_group_state
    )
    from transformers import GenerationMixin

    assert {"generation_config", "continuous_batching_config"} <= set(
        _params(GenerationMixin.init_continuous_batching)
    )


def test_the_config_fields_the_integration_sets() -> None:
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert {
        "scheduler_type",
        "allow_block_sharing",
        "use_cuda_graph",
        "use_async_batching",
        "default_compile_level",
        "varlen_compile_config",
        "decode_compile_config",
        *vars(EngineConfig()),
    } <= fields


def test_block_hashing_the_prefix_cache_keys_by_adapter() -> None:
    """engine.py keys block sharing by adapter: its scheduler wraps the cache's two calls that hash a
    request's blocks (the prefix match of a waiting request, the marking of the blocks a step
    completed) and sets the request's key, which the allocators' ``compute_block_hash`` (looked up as a
    module global at each call) takes as the first block's parent. Should any of this move, the keys
    would silently be lost and KV shared across adapters: this fails first."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator
    from transformers.generation.continuous_batching.scheduler import Scheduler

    assert _params(PagedAttentionCache.search_prefix_match) == ["self", "request_id", "prompt_ids"]
    assert _params(PagedAttentionCache.mark_complete_blocks) == ["self", "state", "complete_blocks"]
    # The only callers of the two, on the engine's thread.
    assert "self.cache.search_prefix_match(state.request_id" in inspect.getsource(
        Scheduler._infer_request_tokens
    )
    assert "self.cache.mark_complete_blocks(state" in inspect.getsource(
        cb.continuous_api.ContinuousBatchProcessor
    )
    # The hash chain starts from None and calls the module's function by its global name.
    assert _params(cache_allocator.compute_block_hash) == ["parent_hash", "tokens"]
    allocator = cache_allocator.CacheAllocator
    match = inspect.getsource(allocator.match_prefix_blocks)
    assert "current_hash = None" in match and "compute_block_hash(current_hash, tokens)" in match
    mark = inspect.getsource(allocator.mark_complete_blocks)
    assert "parent_hash = None" in mark and "compute_block_hash(parent_hash, tokens)" in mark
    source = inspect.getsource(cache_allocator)
    assert source.count("compute_block_hash(") == 3  # its definition and the two calls above
    # The scheduler is built with the cache as its first argument.
    assert _params(Scheduler.__init__)[:2] == ["self", "cache"]
    # The engine's resolved config (its page size: whether a prompt fills a shareable block).
    assert "self.continuous_batching_config = resolve_continuous_batching_config(" in inspect.getsource(
        cb.ContinuousBatchingManager.__init__
    )
    # A prefix match never covers the prompt's last token.
    assert "(len(prompt_ids) - 1) // self.tokens_per_page" in match


def test_the_logits_processor_seam_the_sampler_uses() -> None:
    """engine.py replaces the engine's logits processors by lora_pin's sampler (one row of per-request
    arguments) and leaves the engine greedy: the argmax of the processed logits picks each token, and
    the processed rows are the requests with a new token, in batch order."""
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    from lora_pin.serve.sampling import RowSampler

    assert issubclass(RowSampler, ContinuousBatchingLogitsProcessor)
    assert {"fill_defaults", "prepare_tensor_args", "__call__"} <= set(
        ContinuousBatchingLogitsProcessor.__abstractmethods__
    )
    processors = inspect.getsource(ContinuousBatchingLogitsProcessorList)
    assert "if request.has_new_token" in processors and "self.tensors_required" in processors
    assert "logit_processor.tensors_required" in inspect.getsource(ContinuousBatchingIOs)
    # The manager hands its list (an attribute set at init) to the batch processor it creates.
    assert "logit_processor=self.logit_processor" in inspect.getsource(
        cb.ContinuousBatchingManager._create_batch_processor
    )
    sample = inspect.getsource(ModelRunner._sample)
    assert "torch.argmax(probs, dim=-1, keepdim=True)" in sample and "if self.do_sample" in sample
    # Rows of the processed logits: the logits_indices, appended for requests with a new token in order
    # (then one stale row per other request of the batch, unused).
    prepare = inspect.getsource(ContinuousBatchingIOs)
    assert "logits_indices=self.logits_indices[:num_sequences]" in prepare
    assert prepare.index("if future_state.has_new_token:") < prepare.index(
        "logits_processors.prepare_tensor_args("
    )


def test_the_forward_runs_the_scheduled_requests_tokens_in_order(
    tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path
) -> None:
    """The packed ``[1, T]`` input holds the scheduled requests' tokens, each request's contiguous, in
    the order the scheduler returned (what ``LoRAManager.run_subset`` is told), and the step ends before
    the next round: the adapters' in-flight counts drop to zero."""
    from transformers import AutoModelForCausalLM

    dirs = make_adapters(tmp_path, {"a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "seed": 1}})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    manager = LoRAManager(model, [f"a={dirs['a']}"], max_loras_per_batch=2)
    seen: list[list[int]] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append(args[0].reshape(-1).tolist())
    )
    told: list[tuple[list[int], list[int]]] = []
    run_subset = manager.run_subset
    manager.run_subset = lambda step, requests, tokens: (  # type: ignore[method-assign]
        told.append((list(requests), list(tokens))),
        run_subset(step, requests, tokens),
    )[1]
    engine = LoRAEngine(model, manager, EngineConfig(num_blocks=32, page_size=16, max_batch_tokens=64))
    prompts = {"r0": [10, 11, 12], "r1": [20, 21], "r2": [30, 31, 32, 33]}
    try:
        for rid, prompt in prompts.items():
            engine.submit(rid, prompt, "a" if rid != "r1" else None, max_new_tokens=2, streaming=False)
        engine.start()
        finished = 0
        deadline = time.monotonic() + HANG_GUARD_S
        while finished < 3 and time.monotonic() < deadline:
            output = engine.cb.get_result(timeout=0.5)
            finished += output is not None and output.is_finished()
        assert finished == 3
        # lora_pin offers r1 first (the base model's: no load), then r0 and r2 (a is in no slot yet).
        assert seen[0] == prompts["r1"] + prompts["r0"] + prompts["r2"]
        assert told[0] == ([0, 1, 2], [2, 3, 4])
        # Polled: the step ends when the loop comes round again, on the engine's thread.
        deadline = time.monotonic() + HANG_GUARD_S
        while manager.registry.in_flight("a") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.registry.in_flight("a") == 0
    finally:
        hook.remove()
        engine.stop()
        manager.detach()


def test_the_prefix_cache_shares_blocks_only_under_the_same_key(tiny_llama_dir: Path) -> None:
    """Below HTTP, on the engine itself: one 40-token prompt (two full 16-token pages) run in turn under
    keys k1, k1, k2, none, none, k1: the prompt tokens the cache gave each are 0, 32, 0, 0, 32, 32. If the
    engine stopped hashing through the seam engine.py keys, the k2 and unkeyed runs would get 32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    engine = LoRAEngine(model, None, EngineConfig(num_blocks=32, page_size=16, max_batch_tokens=64))
    prompt = [(7 * i) % 90 + 32 for i in range(40)]
    k1, k2 = "ab" * 32, "cd" * 32
    got = []
    try:
        engine.start()
        for i, key in enumerate([k1, k1, k2, None, None, k1]):
            rid = f"r{i}"
            # Two tokens: the engine hashes a step's completed blocks only for requests still running.
            engine.submit(rid, prompt, None, max_new_tokens=2, streaming=False, prefix_key=key)
            deadline = time.monotonic() + HANG_GUARD_S
            output = None
            while (output is None or not output.is_finished()) and time.monotonic() < deadline:
                output = engine.cb.get_result(request_id=rid, timeout=0.5)
            assert output is not None and output.is_finished()
            got.append(engine.cached_tokens(rid))
            engine.done(rid)
    finally:
        engine.stop()
    assert got == [0, 32, 0, 0, 32, 32]
    assert engine.prefix_stats() == {"queries": 6, "hit_tokens": 96}
