"""lora_pin inside transformers' continuous-batching engine (``init_continuous_batching``, paged KV).

The engine keeps its own loop, scheduler, paged cache and packed ``[1, T]`` forward. lora_pin enters
through one seam the engine offers, its scheduler registry (``SCHEDULER_MAPPING``, chosen by
``ContinuousBatchingConfig.scheduler_type``): a subclass of the engine's scheduler asks the
:class:`~lora_pin.model.LoRAManager` which of the engine's candidate requests may run
(:meth:`~lora_pin.model.LoRAManager.prepare_step`: admits what fits the slots, defers the rest, never fails
mid-batch), lets the engine schedule among those with its own token and cache budgets, and tells the
manager the batch the engine built (:meth:`~lora_pin.model.LoRAManager.run_subset`). The step ends
(:meth:`~lora_pin.model.LoRAManager.finish`) when the engine's loop comes round again, after the forward
and the update of the requests.

What the integration changes in the engine, and why:

- prefix caching (block sharing) is keyed by what a request is served with: the engine hashes blocks by
  their tokens only, so lora_pin starts each request's chain of block hashes from its adapter's content
  digest (:meth:`~lora_pin.model.LoRAManager.identity`; none for the base model). KV computed under one
  adapter is shared only with requests of the same weights (two names with the same weights share, a
  replacement with other weights does not), the base's only with the base. The seam is the engine's
  ``compute_block_hash`` as its cache allocators call it (pinned by ``tests/serve/test_engine_contract.py``);
  ``prefix_caching=False`` turns sharing off;
- sampling and log-probabilities per request: one logits processor of lora_pin's
  (:class:`~lora_pin.serve.sampling.RowSampler`), the engine left greedy;
- CUDA graphs, compiled steps and asynchronous batching are off: the segments' shapes change with every
  step's adapter mix, a step's segments must be those of the batch the forward runs (async batching
  prepares the next batch while the last one runs), and the sampler reads the rows prepared last.

Order and fairness: the engine offers its candidates running requests first, then waiting ones in
arrival order. lora_pin offers the waiting ones in four ranks, each in arrival order: first those that
younger requests overtook in ``OVERDUE_AFTER`` rounds or more (the core's age bound, the same number),
then pinned adapters', then those that cost no load (an adapter's already in a device slot, the base
model's), then the rest. So pinned adapters' requests do not queue behind requests that wait for a slot
or a read, and no request is passed over by younger ones in more than ``OVERDUE_AFTER`` rounds: then it
goes first in the engine's token budget (and the core admits an adapter deferred that long before the
others). A queue served in arrival order overtakes no one, so waiting alone makes no request overdue.
Once a waiting request is deferred for want of a slot, no request after it in that order that needs an
adapter starts in that step (base-model requests still do: they hold no slot), so a deferred request is
not overtaken again and again by the later ones of its rank: the running ones finish, their slots free
up, and it is admitted.

With ``admission_order="longest_remaining"`` lora_pin offers them by the tokens each has left to generate
(``max_new_tokens`` less those generated), most first, running and waiting ones together, after the
overdue ones and those that take no device room (the base model's, pinned adapters'), and starts every
request it admits: when adapter memory is short, a nearly finished request sits out a step for one with
far to go, which shortens a burst (longest remaining processing time first). The core's age bound still
admits every adapter in time.

A request whose adapter failed to read, or was unloaded while it waited, fails alone: it is answered
with its error and the engine goes on.

A request its client gave up (:meth:`LoRAEngine.cancel`) leaves the engine at the start of the next
round of its loop, wherever it was (not yet taken in, waiting, running): its KV-cache pages are freed, its
slot is released with the step that ran it, and the engine forgets it (its record and its result
handler) once no output of it can come any more. :meth:`LoRAEngine.stats` counts what the engine holds.

On CUDA the engine runs its forward on a stream of its own; the manager's calls are made with that stream
current, so the forward waits for the step's slot copies and arrays, and later copies wait for it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lora_pin.errors import AdapterNotFoundError, LoraPinError, SpecError, StalePlanError
from lora_pin.serve.params import SamplingParams
from lora_pin.serve.sampling import RowSampler

if TYPE_CHECKING:
    from lora_pin.model import LoRAManager, Step

__all__ = ["ADMISSION_ORDERS", "EngineConfig", "EngineStats", "LoRAEngine"]

# The orders the engine may offer its requests to lora_pin's admission in (``admission_order``; the
# core's ``AdmissionOrder``): see the module's docs.
ADMISSION_ORDERS = ("arrival", "longest_remaining")

# How often the supervisor checks that the engine's generation thread runs.
_SUPERVISE_INTERVAL_S = 0.2

log = logging.getLogger("lora_pin.serve")

# transformers' share of free device memory for the KV cache when logits are processed.
_MEMORY_PERCENT_WITH_SAMPLER = 0.8

# The prefix-cache key of the request whose blocks the engine's thread hashes now (unset: none).
_hash_key = threading.local()


def _keyed_hashing() -> None:
    """Make the engine's block hashes start from the current request's key (:data:`_hash_key`), once
    per process: the first block of a chain hashes as if its parent's hash were the key. With no key
    set (any other use of the engine) the hashes are the engine's own."""
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    original = cache_allocator.compute_block_hash
    if getattr(original, "lora_pin_keyed", False):
        return

    def compute_block_hash(parent_hash: int | None, tokens: list[int]) -> int:
        if parent_hash is None:
            parent_hash = getattr(_hash_key, "key", None)
        return int(original(parent_hash, tokens))

    compute_block_hash.lora_pin_keyed = True  # type: ignore[attr-defined]
    cache_allocator.compute_block_hash = compute_block_hash


class EngineConfig:
    """The engine's own settings (the ``--max-batch-tokens``, ``--num-blocks``, ``--page-size``,
    ``--max-memory-percent`` flags): None leaves the engine's default."""

    def __init__(
        self,
        *,
        max_batch_tokens: int | None = None,
        num_blocks: int | None = None,
        page_size: int | None = None,
        max_memory_percent: float | None = None,
        max_requests_per_batch: int | None = None,
    ) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.max_memory_percent = max_memory_percent
        self.max_requests_per_batch = max_requests_per_batch


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds now (:meth:`LoRAEngine.stats`), in requests.

    Attributes:
        queued: submitted and not started (in the engine's waiting queue, or not taken in yet).
        running: started and not finished (holding KV-cache pages).
        tracked: requests the engine keeps a record of: submitted and not yet :meth:`~LoRAEngine.done`,
            or cancelled and not yet let go by the engine.
        result_handlers: per-request result handlers registered on the engine's output router.
    """

    queued: int
    running: int
    tracked: int
    result_handlers: int


class LoRAEngine:
    """transformers' continuous-batching engine over ``model``, with ``manager``'s adapters per request.

    Args:
        model: a transformers causal LM (the one ``manager`` wraps); the engine switches its attention to
            a paged implementation while it runs.
        manager: the LoRA manager, or None to serve the base model alone (the engine's own defaults).
        config: the engine's settings.
        eos_token_id: the token(s) that end a request.
        prefix_caching: share KV-cache blocks among requests with the same prompt prefix and the same
            adapter weights (module docs); False: never share.
        admission_order: ``"arrival"`` or ``"longest_remaining"`` (module docs, "Order and fairness").

    Requests go in with :meth:`submit` and come out through the engine's own ``register_result_handler``
    (``engine.cb``, a ``ContinuousBatchingManager``); :meth:`done` after the last output, :meth:`cancel`
    when the client gives up before it. Each request is decoded greedily or sampled as its
    :class:`~lora_pin.serve.params.SamplingParams` say (:attr:`sampler`).

    Raises:
        SpecError: an unknown ``admission_order``.
        ValueError, RuntimeError: from transformers, when the model cannot run continuous batching.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        manager: LoRAManager | None,
        config: EngineConfig | None = None,
        *,
        eos_token_id: int | list[int] | None = None,
        prefix_caching: bool = True,
        admission_order: str = "arrival",
    ) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList,
        )
        from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING
        from transformers.generation.logits_process import LogitsProcessorList

        if admission_order not in ADMISSION_ORDERS:
            raise SpecError(
                f"admission_order must be one of {', '.join(ADMISSION_ORDERS)} (got {admission_order!r})"
            )
        config = config or EngineConfig()
        self.manager = manager
        self.admission_order = admission_order
        self._lock = threading.Lock()
        # Every request from submit() to done(), or to the round after its cancel() that lets it go.
        self._adapter_of: dict[str, str | None] = {}
        # Those of them the engine's scheduler has taken in, and those cancelled.
        self._arrived: set[str] = set()
        self._cancelled: set[str] = set()
        self._step: Step | None = None
        self._index: dict[str, int] = {}
        # Waiting requests -> the rounds in which a younger waiting request started and they did not.
        self._overtaken: dict[str, int] = {}
        # This round's waiting requests, in arrival order.
        self._waiting: list[str] = []
        self._stopping = threading.Event()
        self.restarts = 0
        # Requests -> the prefix-cache key their block hashes start from (absent: the base model's).
        self._prefix_key: dict[str, int] = {}
        # Requests -> the prompt tokens the prefix cache gave them.
        self._cached: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self._evictions: dict[tuple[str, str], int] = {}
        self.sampler = RowSampler()
        self.eos_token_id = eos_token_id
        self.prefix_caching = prefix_caching
        # Installed with LoRA off too: it lets cancelled requests go.
        scheduler_type = f"lora_pin-{id(self):x}"
        SCHEDULER_MAPPING[scheduler_type] = _scheduler_class(self, SCHEDULER_MAPPING["fifo"])
        self._scheduler_type = scheduler_type
        settings = {k: v for k, v in vars(config).items() if v is not None}
        if next(model.parameters()).device.type == "cuda":
            # On CUDA the engine leaves more free memory beside its cache when it processes logits (0.8,
            # not 0.9): the sampler's vocabulary-sized temporaries need it, though at init the engine
            # sees no processor (CPU keeps the engine's own 0.6).
            settings.setdefault("max_memory_percent", _MEMORY_PERCENT_WITH_SAMPLER)
        cb_config = ContinuousBatchingConfig(
            scheduler_type=scheduler_type,
            allow_block_sharing=prefix_caching,
            use_cuda_graph=False,
            use_async_batching=False,
            default_compile_level=0,
            **settings,
        )
        generation = GenerationConfig(
            do_sample=False, eos_token_id=-1 if eos_token_id is None else eos_token_id
        )
        self.cb: Any = model.init_continuous_batching(  # type: ignore[operator]
            generation_config=generation, continuous_batching_config=cb_config
        )
        # The engine's processors come from the generation config, greedy here: none. lora_pin's sampler
        # takes their place, with one row of per-request arguments (its row numbers).
        self.page_size = int(self.cb.continuous_batching_config.page_size)
        processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([self.sampler]))
        processors.tensors_required = 1
        self.cb.logit_processor = processors

    # ---- the engine's side -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine's generation thread, and a supervisor that starts it again should it end."""
        self._stopping.clear()
        self.cb.start()
        supervisor = threading.Thread(target=self._supervise, name="lora_pin-engine-supervisor", daemon=True)
        supervisor.start()

    def _supervise(self) -> None:
        # The engine ends its thread on an error inside a step (its forward raising, say), after failing
        # the requests it holds, which are answered with that error. The server serves on.
        while not self._stopping.wait(_SUPERVISE_INTERVAL_S):
            if not self.cb.is_running() and not self._stopping.is_set():
                self.restarts += 1
                log.error("the engine's generation thread ended on an error; starting it again")
                self._end_step()
                # The engine failed every request it held and starts with an empty scheduler.
                with self._lock:
                    gone = self._cancelled & self._arrived
                for request_id in gone:
                    self._forget(request_id)
                self.cb.start()

    def stop(self) -> None:
        """Stop the generation thread (requests in flight are failed) and forget the scheduler."""
        from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

        self._stopping.set()
        if self.cb.is_running():
            self.cb.stop(block=True, timeout=30, hard_stop=True)
        SCHEDULER_MAPPING.pop(self._scheduler_type, None)

    def is_alive(self) -> bool:
        """Whether the generation thread runs."""
        return bool(self.cb.is_running())

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        adapter: str | None,
        *,
        max_new_tokens: int,
        streaming: bool,
        ignore_eos: bool = False,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        prefix_key: str | None = None,
    ) -> None:
        """Queue ``prompt_ids`` for generation with ``adapter`` (None: the base model) as ``request_id``;
        ``ignore_eos``: generate ``max_new_tokens`` whatever comes (load tests); ``sampling``: how its
        tokens are picked (None: greedy); ``stop_token_ids``: tokens that end it besides the
        end-of-sequence one(s); ``prefix_key``: what its KV blocks are shared by (the adapter's content
        digest, hex; None: the base model's).

        Register a result handler for ``request_id`` on :attr:`cb` first, so no output is missed.

        Raises:
            RuntimeError: the engine is stopping and takes no more requests.
        """
        with self._lock:
            self._adapter_of[request_id] = adapter
            if prefix_key is not None:
                self._prefix_key[request_id] = int(prefix_key[:16], 16)
        if sampling is not None:
            self.sampler.register(request_id, sampling)
        eos = [] if ignore_eos or self.eos_token_id is None else self.eos_token_id
        ends = [*([eos] if isinstance(eos, int) else eos), *stop_token_ids]
        accepted = self.cb.add_request(
            list(prompt_ids),
            request_id=request_id,
            max_new_tokens=max_new_tokens,
            streaming=streaming,
            record_timestamps=True,
            eos_token_id=ends or -1,
        )
        if accepted is None:
            self.done(request_id)
            raise RuntimeError("the engine is not accepting requests (it is stopping)")

    def done(self, request_id: str) -> None:
        """Forget ``request_id`` (its last output was delivered)."""
        with self._lock:
            self._adapter_of.pop(request_id, None)
            self._arrived.discard(request_id)
            self._cancelled.discard(request_id)
            self._prefix_key.pop(request_id, None)
            self._cached.pop(request_id, None)
        self.sampler.forget(request_id)

    def shares_prefix(self, prompt_len: int) -> bool:
        """Whether a later request with the same first ``prompt_len`` tokens (and adapter) would be
        given some of their KV by the prefix cache: caching is on and the prompt fills a page."""
        return self.prefix_caching and prompt_len - 1 >= self.page_size

    def cached_tokens(self, request_id: str) -> int:
        """The prompt tokens of ``request_id`` whose KV the prefix cache gave it (0 until it starts)."""
        with self._lock:
            return self._cached.get(request_id, 0)

    def cancel(self, request_id: str) -> None:
        """Give up ``request_id`` before its last output: the engine drops it at the start of its next
        round, wherever it is (its KV-cache pages freed, its slot released with the step that ran it),
        then forgets it and removes its result handler; an output it still makes meanwhile goes to that
        handler. A request that is done or unknown: nothing happens. Thread-safe."""
        with self._lock:
            if request_id not in self._adapter_of:
                return
            self._cancelled.add(request_id)
        # Also wakes the engine's loop, which may be idle: a request that ended unseen is forgotten then.
        self.cb.cancel_request(request_id)

    def stats(self) -> EngineStats:
        """The requests the engine holds now (see :class:`EngineStats`); cheap, any thread."""
        processor = self.cb.batch_processor
        scheduler = None if processor is None else processor.scheduler
        waiting = 0 if scheduler is None else len(scheduler.waiting_requests)
        running = 0 if scheduler is None else len(scheduler.active_requests)
        with self._lock:
            tracked = len(self._adapter_of)
            not_taken_in = tracked - len(self._arrived) - len(self._cancelled - self._arrived)
        return EngineStats(
            queued=max(0, not_taken_in) + waiting,
            running=running,
            tracked=tracked,
            result_handlers=len(self.cb.output_router.result_handlers),
        )

    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's work so far: ``queries`` (requests looked up when they started) and
        ``hit_tokens`` (prompt tokens whose KV was shared rather than computed)."""
        return {"queries": self.prefix_queries, "hit_tokens": self.prefix_hit_tokens}

    def _install_prefix_keys(self, cache: Any) -> None:
        """Key ``cache``'s block sharing by each request's :meth:`submit` ``prefix_key`` (module docs):
        its two calls that hash a request's blocks run with that request's key set."""
        _keyed_hashing()
        search, mark = cache.search_prefix_match, cache.mark_complete_blocks

        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            with self._lock:
                _hash_key.key = self._prefix_key.get(request_id)
            try:
                found = int(search(request_id, prompt_ids))
            finally:
                _hash_key.key = None
            with self._lock:
                self.prefix_queries += 1
                self.prefix_hit_tokens += found
                if request_id in self._adapter_of:
                    self._cached[request_id] = found
            return found

        def mark_complete_blocks(state: Any, complete_blocks: Any) -> None:
            with self._lock:
                _hash_key.key = self._prefix_key.get(state.request_id)
            try:
                mark(state, complete_blocks)
            finally:
                _hash_key.key = None

        cache.search_prefix_match = search_prefix_match
        cache.mark_complete_blocks = mark_complete_blocks

    def _log_evictions(self) -> None:
        """One log line per adapter eviction since the last step's (engine's thread, after each plan)."""
        if self.manager is None:
            return
        current = self.manager.evictions()
        if current == self._evictions:
            return
        for (name, tier), count in current.items():
            for _ in range(count - self._evictions.get((name, tier), 0)):
                log.info("adapter %r: evicted from the %s tier", name, tier)
        self._evictions = current

    def _forget(self, request_id: str) -> None:
        """Drop every record of ``request_id``: the engine holds it no more and makes no output of it."""
        self.done(request_id)
        self.cb.output_router.result_handlers.pop(request_id, None)

    # ---- cancellation (runs on the engine's thread) ------------------------------------------------

    def _taken_in(self, request_id: str) -> None:
        """The engine's scheduler took ``request_id`` into its waiting queue."""
        with self._lock:
            if request_id in self._adapter_of:
                self._arrived.add(request_id)

    def _drop_cancelled(self, scheduler: Any) -> list[str]:
        """Mark the cancelled requests the scheduler holds for its own removal, which follows; returns
        every cancelled request it has taken in (the engine forgets them after the removal)."""
        with self._lock:
            gone = list(self._cancelled & self._arrived)
        for request_id in gone:
            if request_id in scheduler.active_requests or request_id in scheduler.waiting_requests:
                scheduler.set_request_cancellation(request_id)
        return gone

    # ---- the scheduler's side (runs on the engine's thread) -------------------------------------------

    def _forward_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The stream the engine's forward runs on, made current (on CPU: nothing).

        The manager queues its slot copies' waits, its step arrays and its end-of-step marks on the
        current stream; the engine runs its forward on a stream of its own (``compute_stream``). Queued
        there, the forward waits for the step's copies, and a later copy into one of its slots waits for
        the forward.
        """
        processor = self.cb.batch_processor
        stream = None if processor is None else processor.inputs_and_outputs.compute_stream
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def _end_step(self) -> None:
        """Finish the last step: its forward ran and its requests were updated."""
        step, self._step = self._step, None
        if step is None or self.manager is None:
            return
        try:
            with self._forward_stream():
                self.manager.finish(step)
        except StalePlanError as e:
            # Cannot happen while unloads wait for steps; logged rather than silently ignored.
            log.error("a step's slot was rewritten while it ran: %s", e)

    def _offer_order(self, candidates: list[Any], adapters: list[str | None]) -> list[int]:
        """The order lora_pin offers ``candidates`` in (indices): the core's ranking
        (:meth:`LoRAManager.offer_order`) of the running ones and the waiting ones, each waiting one with
        the rounds in which younger ones overtook it (counted here: the core knows no request ids)."""
        assert self.manager is not None
        counts: dict[str, int] = {}
        waiting: list[str] = []
        overtaken: list[int | None] = []
        for state in candidates:
            if state.status.name != "PENDING":
                overtaken.append(None)
                continue
            count = self._overtaken.get(state.request_id, 0)
            counts[state.request_id] = count
            waiting.append(state.request_id)
            overtaken.append(count)
        # Started requests (and gone ones) leave the count: only this round's waiting ones stay.
        self._overtaken = counts
        self._waiting = waiting
        if self.admission_order == "arrival":
            return self.manager.offer_order(adapters, overtaken)
        remaining = [
            None if s.max_new_tokens is None else max(0, s.max_new_tokens - s.generated_len())
            for s in candidates
        ]
        return self.manager.offer_order(adapters, overtaken, remaining=remaining, order=self.admission_order)

    def _admit(self, scheduler: Any, candidates: list[Any], removed: set[str]) -> list[Any]:
        """The candidates lora_pin admits this step, in the order it offers them (see the module's
        docs); fails those whose adapter is gone."""
        if self.manager is None:
            return candidates
        self._end_step()
        with self._lock:
            adapters = [self._adapter_of.get(s.request_id) for s in candidates]
        order = self._offer_order(candidates, adapters)
        candidates = [candidates[i] for i in order]
        adapters = [adapters[i] for i in order]
        manager = self.manager
        kept: list[Any] = []
        names: list[str | None] = []
        for state, name in zip(candidates, adapters, strict=True):
            if name is not None and name not in manager:
                self._fail(scheduler, state, AdapterNotFoundError(f"adapter {name!r} was unloaded"), removed)
            else:
                kept.append(state)
                names.append(name)
        if not kept:
            return []
        tokens = [1 if s.status.name == "DECODING" else max(1, len(s.remaining_prefill_tokens)) for s in kept]
        try:
            with self._forward_stream():
                step = self.manager.prepare_step(names, tokens)
        except (AdapterNotFoundError, StalePlanError) as e:
            # An unload (or a rewritten slot) between the check and the plan: the next loop plans again.
            log.info("step planned again: %s", e)
            return []
        except LoraPinError as e:
            for state in kept:
                self._fail(scheduler, state, e, removed)
            return []
        self._step = step
        for i, error in step.failed.items():
            self._fail(scheduler, kept[i], error, removed)
        waiting = [s.status.name == "PENDING" for s in kept]
        start = self.manager.startable(step, waiting, order=self.admission_order)
        self._index = {kept[i].request_id: i for i in start}
        return [kept[i] for i in start]

    def _run(self, scheduled: list[Any]) -> None:
        """Tell the manager the batch the engine built: its requests in order, with its token counts.
        Counts a round against each waiting request that a younger one overtook."""
        if self._step is None or self.manager is None or not scheduled:
            return
        started = {f.state.request_id for f in scheduled}
        youngest = max((i for i, r in enumerate(self._waiting) if r in started), default=-1)
        for request_id in self._waiting[:youngest]:
            if request_id not in started:
                self._overtaken[request_id] += 1
        with self._forward_stream():
            self.manager.run_subset(
                self._step,
                [self._index[f.state.request_id] for f in scheduled],
                [f.query_length for f in scheduled],
            )

    def _fail(self, scheduler: Any, state: Any, error: Exception, removed: set[str]) -> None:
        """Answer one request with ``error`` and drop it from the engine; the batch goes on."""
        request_id = state.request_id
        log.warning("request %s failed: %s", request_id, error)
        scheduler.waiting_requests.pop(request_id, None)
        removed.add(request_id)
        state.generated_tokens = list(state.generated_tokens)
        scheduler.finish_request(request_id)
        self.cb.output_router.fail_and_deliver(state, error)


def _scheduler_class(engine: LoRAEngine, base: type[Any]) -> type[Any]:
    """The engine's scheduler ``base`` with lora_pin's admission in front of its own budgets."""

    class LoRAScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, cache: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(cache, *args, **kwargs)
            engine._install_prefix_keys(cache)

        def clear_cancelled_requests(self) -> list[Any]:
            # Called first in every round of the engine's loop: the last step's forward and update are
            # over, and its outputs delivered, so no output of a request removed now can come any more.
            engine._end_step()
            gone = engine._drop_cancelled(self)
            cancelled: list[Any] = super().clear_cancelled_requests()
            for request_id in gone:
                engine._forget(request_id)
            return cancelled

        def add_waiting_request(self, state: Any) -> None:
            super().add_waiting_request(state)
            engine._taken_in(state.request_id)

        def _process_candidates(
            self, candidates: list[Any], token_budget: int, cache_budget: int, removed: set[str]
        ) -> Any:
            admitted = engine._admit(self, candidates, removed)
            engine._log_evictions()
            result = super()._process_candidates(admitted, token_budget, cache_budget, removed)
            engine._run(result[0])
            return result

    return LoRAScheduler
