"""The manager: one object that serves many LoRA adapters over one Hugging Face-style model.

It ties the pieces together: the Rust registry decides admission, slots, loads and evictions; the host
tier and the device pool hold the tensors; the model's target linears are wrapped with
:class:`~lora_pin.model.layers.LoRALinear`, which run the ``lora_pin`` ops for the active step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lora_pin._core import LoRARef, LoRARegistry, parse_lora_paths
from lora_pin.args import DEFAULT_MAX_LORAS_PER_BATCH, LoRAConfig, lora_config_from_args
from lora_pin.errors import (
    AdapterNotFoundError,
    DuplicateAdapterError,
    LoraPinError,
    SpecError,
    StalePlanError,
    UsageError,
)
from lora_pin.model.attach import FusedSpec, attach, detach, model_targets
from lora_pin.model.layers import StepSegments
from lora_pin.model.loader import BackgroundLoads
from lora_pin.model.residency import Residency
from lora_pin.ops import CUDA_CHUNK_SIZE, SegmentBatch
from lora_pin.unloading import unload_async
from lora_pin.weights import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_TENSORS,
    MAX_ADAPTER_RANK,
    DevicePool,
    HostTier,
)
from lora_pin.weights.reader import adapter_dir_for_name, path_within, read_contained_config
from lora_pin.weights.targets import ModuleSelection

if TYPE_CHECKING:
    from lora_pin.parallel import TensorParallel

__all__ = ["LOADING_MODES", "LoRAManager", "Step"]

# How often a step reads adapters evicted from host memory before it begins, should other threads evict
# them again meanwhile; then the step reads them itself.
_READ_FIRST_ATTEMPTS = 2
# As many for a batch waiting for background reads: one round may find the host tier full of adapters
# being read (prefetched), and starts the batch's own reads only once those are done.
_FETCH_FIRST_ATTEMPTS = 4

LOADING_MODES = ("background", "blocking")


@dataclass(frozen=True)
class Step:
    """One planned scheduler step (from :meth:`LoRAManager.prepare_step` or :meth:`LoRAManager.batch`).

    Attributes:
        admitted: indices (into the step's requests) of the requests that run this step, in batch order.
        deferred: indices of the requests that must wait for a later step (they hold nothing), in
            request order: resubmit them first, in this order. In background loading these include the
            requests whose adapter is being read from disk.
        request_slots: int32 ``[len(admitted)]``, the device slot of each admitted request, -1 for base.
        segments: the token grouping the LoRA layers use; tokens are the admitted requests' tokens,
            each request's contiguous, in ``admitted`` order.
        num_tokens: ``T``, the admitted requests' tokens.
        failed: request index -> why its adapter could not be loaded (a background read that failed);
            these requests are neither admitted nor deferred. A later request for the adapter tries again.
        loading: the deferred requests whose adapter is not in host memory: being read in the background,
            or waiting for host memory to be read into (in request order; background loading only). They
            cost a step nothing until admitted: a scheduler may resubmit them without counting them
            against its batch budget.
    """

    admitted: tuple[int, ...]
    deferred: tuple[int, ...]
    request_slots: torch.Tensor
    segments: SegmentBatch
    num_tokens: int
    _ticket: int
    _slot_writes: tuple[tuple[int, int], ...] = ()
    failed: Mapping[int, LoraPinError] = field(default_factory=dict)
    loading: tuple[int, ...] = ()


def _buffer(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer from the core as a tensor on ``device`` (no Python loop; empty buffers allowed)."""
    if len(data) == 0:
        return torch.empty(0, dtype=dtype, device=device)
    # The plan's getters hand out a fresh bytearray each call: the tensor may own it, no copy needed.
    host = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=dtype)
    if device.type == "cuda":
        # From pinned memory the copy is queued on the stream and the host goes on: a copy from pageable
        # memory would wait for every kernel already queued, once per array per step. (The caching host
        # allocator keeps the pinned block until the copy has run.)
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class LoRAManager:
    """Serves the adapters named by ``lora_paths`` over ``model``, ``max_loras_per_batch`` at a time.

    Args:
        model: a Hugging Face-style causal LM (Llama, Mistral, Qwen2 ...) whose target linears get wrapped.
        lora_paths: start-up adapters, in any form :func:`lora_pin.parse_lora_paths` takes.
        max_loras_per_batch: device slots (distinct adapters one step can use).
        max_loaded_loras: host-tier capacity in adapters (None: unbounded).
        max_lora_rank: the slot pool's rank; None takes the largest start-up adapter's, once each is
            read and checked (tensors included: a config's claimed rank alone never sizes the pool).
        lora_target_modules: the modules to wrap, as PEFT's ``target_modules``: names (``q_proj`` wraps
            every module whose key ends in ``.q_proj``; ``mlp.c_proj`` only those) or one regex string
            matched against whole module keys; ``["all"]`` wraps every linear layer of the model but its
            output layer (PEFT's ``all-linear``: later loads may target any of them); None takes every module
            the start-up adapters' ``target_modules`` select in this model (for names, in every layer).
        eviction_policy: the device tier's policy: ``"lru"``, ``"fifo"``, ``"reuse"`` or ``"hybrid"``
            (host tier: LRU).
        max_host_bytes: optional host-tier capacity in bytes.
        allowed_roots: if given, every adapter path must resolve under one of these folders.
        adapter_dir: a folder of adapters loaded on first use: a step (or :meth:`discover`) naming an
            adapter that is not registered loads ``adapter_dir/<name>`` (names may be nested,
            ``org/style``). Each such adapter is confined to ``adapter_dir``: no ``..``, no absolute
            name, no symlink out of it. Must lie under ``allowed_roots`` when both are given.
        allow_pickle: allow ``adapter_model.bin`` (loaded with ``torch.load(weights_only=True)``).
        chunk_size: longest segment the kernels see, in tokens. None picks by device: whole segments
            on CPU (the grouped path merges chunks again anyway), :data:`lora_pin.ops.CUDA_CHUNK_SIZE`
            on CUDA, where each segment's rows go to one program: whole segments would leave most
            multiprocessors idle in a prefill step with few adapters.
        fused_modules: for models whose projections are fused (a ``qkv_proj`` computing ``[q | k | v]``),
            the adapter modules stacked in each fused module's output with their widths, e.g.
            ``{"qkv_proj": [("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)],
            "gate_up_proj": [("gate_proj", 14336), ("up_proj", 14336)]}``; one shrink then serves the
            whole fused output. Leave None for models with separate projections (Hugging Face Llama ...).
        max_file_bytes, max_tensors: per-adapter limits on the weight file (see
            :mod:`lora_pin.weights.limits`), checked before any tensor is read.
        loading: ``"background"`` (the default without ``tp``): a step never reads from disk; a request
            whose adapter is not in host memory is deferred while a background loader reads it, and is
            admitted by a later step. ``"blocking"``: a step reads what it needs before it begins, and
            every request waits for that (the default, and the only mode, with ``tp``: ranks must install
            a read at the same step). :meth:`batch` waits for its reads in either mode (it must run whole).
        load_workers: threads of the background loader (reads run at once).
        tp: this process's place in a tensor-parallel group (:class:`lora_pin.parallel.TensorParallel`),
            for a model whose linears are a framework's parallel layers
            (:func:`lora_pin.parallel.register_parallel_linear`): each rank reads and holds only its shard
            of every adapter, and loads (start-up ones included) are collective, every rank of the group
            calling them in the same order (see :mod:`lora_pin.parallel`). ``fully_sharded`` needs
            ``max_lora_rank``. A model cut by transformers' ``tp_plan`` (``DTensor`` weights) is found
            without it.

    Thread safety: loads, unloads, pins, unpins and prefetches may run from other threads while a step is
    active; background reads run on the loader's own threads and enter the host tier only at a step's
    start (or while :meth:`batch` / :meth:`split` wait for them). A step is one core transaction: its
    plan and the acquisition of its requests happen at once, so an unload of one of its adapters waits
    for the step to finish, and the name cannot be registered again meanwhile. Every write into the
    device pool and every host-tier change happens under one lock
    (:class:`~lora_pin.model.residency.Residency`), and each step checks that every slot it uses holds the
    contents its plan's slot generation names (:class:`StalePlanError` otherwise), both when it starts
    and when it finishes.

    Raises:
        SpecError: the specs or limits are invalid, the rank/target modules cannot be determined,
            ``adapter_dir`` is not a folder (or lies outside ``allowed_roots``), ``loading`` is not a mode
            or ``load_workers`` is below 1.
        AdapterLoadError: a start-up adapter cannot be served (the message names it and why); nothing is
            attached then.
        PoolError: the device pool cannot be allocated.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lora_paths: Any = None,
        *,
        max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH,
        max_loaded_loras: int | None = None,
        max_lora_rank: int | None = None,
        lora_target_modules: Sequence[str] | str | None = None,
        eviction_policy: str = "lru",
        max_host_bytes: int | None = None,
        allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
        adapter_dir: str | os.PathLike[str] | None = None,
        allow_pickle: bool = False,
        chunk_size: int | None = None,
        fused_modules: FusedSpec | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_tensors: int = DEFAULT_MAX_TENSORS,
        loading: str | None = None,
        load_workers: int = 2,
        tp: TensorParallel | None = None,
    ) -> None:
        if loading is not None and loading not in LOADING_MODES:
            raise SpecError(f"loading must be one of {', '.join(LOADING_MODES)} (got {loading!r})")
        if isinstance(load_workers, bool) or not isinstance(load_workers, int) or load_workers < 1:
            raise SpecError(f"load_workers must be an int of at least 1 (got {load_workers!r})")
        refs = parse_lora_paths(
            lora_paths, max_loras_per_batch=max_loras_per_batch, max_loaded_loras=max_loaded_loras
        )
        self._allowed_roots = None if allowed_roots is None else tuple(allowed_roots)
        self.adapter_dir = (
            None if adapter_dir is None else _checked_adapter_dir(adapter_dir, self._allowed_roots)
        )
        rank, modules = self._infer_shape(refs, max_lora_rank, lora_target_modules)
        param = next(model.parameters())
        self.model = model
        self.dtype, self.device = param.dtype, param.device
        if chunk_size is None and self.device.type == "cuda":
            chunk_size = CUDA_CHUNK_SIZE
        self.targets, self._module_of = model_targets(model, modules, fused_modules)
        if modules is not None and lora_target_modules is not None:
            missing = modules.unmatched(t.key for t in self.targets.linears)
            if missing:
                raise SpecError(
                    f"lora_target_modules names {missing}, which select none of the model's linear layers "
                    f"(it has {list(self.targets.module_names)})"
                )
        self.chunk_size = chunk_size
        from lora_pin.parallel.api import manager_shard_plan

        shards, self._collectives = manager_shard_plan(model, self.targets, self._module_of, tp, rank)
        self.tp = None if shards is None else shards.tp
        loading = _loading_mode(loading, self.tp is not None, adapter_dir is not None)
        host = HostTier(
            self.targets,
            max_rank=MAX_ADAPTER_RANK if rank is None else rank,
            dtype=self.dtype,
            allowed_roots=self._allowed_roots,
            allow_pickle=allow_pickle,
            max_file_bytes=max_file_bytes,
            max_tensors=max_tensors,
            shards=shards,
        )
        # Without max_lora_rank the pool is sized by the start-up adapters, read (and checked, tensors
        # included) first: a config's claim alone never sizes it.
        if self.tp is not None:
            from lora_pin.parallel.collective import agreed

            # Each rank reads its own shards: all of them start, or none.
            startup: list[Any]
            startup, _ = agreed(
                self.tp,
                "start-up adapters",
                lambda: [host.read(r.lora_name, r.lora_path) for r in refs],
                self._collectives,
            )
        else:
            startup = [host.read(r.lora_name, r.lora_path) if rank is None else None for r in refs]
        if rank is None:
            rank = max(a.max_rank for a in startup if a is not None)
            host.max_rank = rank
        self.max_rank = rank
        if shards is not None:
            shards.bind(rank)
        pool = DevicePool(self.targets, max_loras_per_batch, rank, self.dtype, self.device, shards=shards)
        self.registry = LoRARegistry(
            max_loras_per_batch,
            max_loaded_loras,
            max_host_bytes=max_host_bytes,
            eviction_policy=eviction_policy,
            chunk_size=chunk_size,
        )
        self.residency = Residency(self.registry, host, pool)
        self.pool, self.host = pool, host
        self._step_lock = threading.Lock()
        self._active: StepSegments | None = None
        self._active_step: Step | None = None
        self._deferred_requests = 0
        self.loading = loading
        self._loads = BackgroundLoads(self.residency, load_workers)
        # Adapters of the groups after the first of the last split, prefetched by the next step.
        self._prefetch_next: list[str] = []
        self._wrapped: dict[str, torch.nn.Module] = {}
        for r, adapter in zip(refs, startup, strict=True):
            self.residency.add(r, adapter=adapter)
        self._wrapped = attach(
            model, self.targets, self._module_of, self.pool, self._active_segments, shards, self._collectives
        )

    @classmethod
    def from_args(cls, model: torch.nn.Module, namespace: argparse.Namespace, **kwargs: Any) -> LoRAManager:
        """A manager configured from the server args :func:`lora_pin.add_lora_args` added and parsed.

        Raises:
            SpecError: LoRA is off (no LoRA flag was given), or as :func:`lora_pin.lora_config_from_args`.
            AdapterLoadError, PoolError: as the constructor.
        """
        cfg = lora_config_from_args(namespace)
        if cfg is None:
            raise SpecError("LoRA is off: no LoRA flag was given (pass --enable-lora or --lora-paths)")
        return cls.from_config(model, cfg, **kwargs)

    @classmethod
    def from_config(cls, model: torch.nn.Module, config: LoRAConfig, **kwargs: Any) -> LoRAManager:
        """A manager configured by ``config`` (from :func:`lora_pin.lora_config_from_args` or
        :func:`lora_pin.lora_config_from_vllm_args`); ``kwargs`` go to the constructor.

        Raises:
            SpecError: ``config.lora_dtype`` is neither ``"auto"`` nor the model's dtype.
            AdapterLoadError, PoolError: as the constructor.
        """
        if config.lora_dtype != "auto":
            dtype = next(model.parameters()).dtype
            if getattr(torch, config.lora_dtype, None) != dtype:
                raise SpecError(
                    f"lora_dtype={config.lora_dtype!r} but the model is {dtype}: lora_pin computes adapters "
                    "in the model's dtype (adapters of another dtype are converted on load); use 'auto'"
                )
        return cls(
            model,
            list(config.refs),
            max_loras_per_batch=config.max_loras_per_batch,
            max_loaded_loras=config.max_loaded_loras,
            max_lora_rank=config.max_lora_rank,
            lora_target_modules=config.target_modules,
            eviction_policy=config.eviction_policy,
            **kwargs,
        )

    # ---- adapters -------------------------------------------------------------------------------

    def load(self, name: str, path: str | os.PathLike[str], *, pinned: bool = False) -> LoRARef:
        """Load the adapter at ``path`` as ``name`` (a fresh random id) into the host tier and register it.

        Raises:
            AdapterLoadError: the adapter cannot be served; PathNotAllowedError / UnsafeFormatError likewise.
            DuplicateAdapterError: ``name`` is registered.
            CapacityError: the host tier is full of adapters that cannot be evicted, or pinning would leave
                no slot for unpinned adapters. In every case nothing changes.
        """
        if self.tp is not None:
            return self._load_agreed(name, os.fspath(path), pinned)
        ref = LoRARef.new(name, os.fspath(path), pinned)
        self.residency.add(ref)
        return ref

    def discover(self, names: Iterable[str | None]) -> list[str]:
        """Load from ``adapter_dir`` every adapter of ``names`` that is not registered yet (None entries
        and registered names are skipped); returns the names loaded, in order.

        Reads on the calling thread (:meth:`prefetch` reads in the background instead; so do steps in
        background loading, while steps in blocking loading call this). All or nothing: every name is
        checked before any is read, and if one fails to load, those this call loaded are unloaded again
        (the host tier may still have evicted idle adapters to make room; they are read again on demand).

        Raises:
            UsageError: ``names`` is a str, or an entry is neither a str nor None.
            AdapterNotFoundError: a name is not registered and there is no ``adapter_dir`` or no
                folder ``adapter_dir/<name>``.
            PathNotAllowedError: a name is not a plain (possibly nested) folder name, or its folder
                resolves outside ``adapter_dir``.
            AdapterLoadError, CapacityError: as :meth:`load`.
        """
        names = _checked_names(names)
        # Each distinct name once: a step repeats a few names many times.
        found = self._folders([n for n in dict.fromkeys(names) if n is not None and n not in self.registry])
        root = self.adapter_dir
        loaded: list[str] = []
        try:
            for name, directory in found.items():
                try:
                    self.residency.add(LoRARef.new(name, str(directory), False), root=root)
                except DuplicateAdapterError:
                    continue  # registered meanwhile by another thread: theirs stands
                loaded.append(name)
        except BaseException:
            for name in loaded:
                # A step on another thread may have taken it up meanwhile: then it stays (it loaded
                # fine), rather than be torn down under that step.
                if self.registry.in_flight(name) == 0 and self.registry.try_unload(name):
                    self.residency.forget(name)
            raise
        return loaded

    def pin(self, name: str) -> None:
        """Keep ``name`` resident in both tiers until :meth:`unpin`.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.
            CapacityError: fewer than one slot would stay for unpinned adapters (the message has the numbers).

        With ``tp``, every rank calls it; if it fails on any rank it is undone where it succeeded and every
        rank raises.
        """
        self._collectively(
            f"pin of {name!r}", lambda: self.registry.pin(name), lambda: self.registry.unpin(name)
        )

    def unpin(self, name: str) -> None:
        """Make ``name`` evictable again.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.

        With ``tp``, collective as :meth:`pin`.
        """
        self._collectively(
            f"unpin of {name!r}", lambda: self.registry.unpin(name), lambda: self.registry.pin(name)
        )

    def unload(self, name: str, timeout: float | None = None) -> None:
        """Unregister ``name`` (no new requests), wait for its running requests, then free its weights.

        Idempotent for a name that was registered.

        Raises:
            AdapterNotFoundError: ``name`` was never registered.
            UnloadTimeoutError: requests still use it after ``timeout`` seconds (it stays unregistered).

        With ``tp``, every rank calls it and raises if it failed on any rank (an unload is not undone: the
        name stays unregistered everywhere, the ranks that drained it have freed its weights).
        """

        def unload() -> None:
            self.registry.unload(name, timeout)
            self._forget(name)

        self._collectively(f"unload of {name!r}", unload)

    async def unload_async(self, name: str, timeout: float | None = None) -> None:
        """:meth:`unload` for asyncio code: polls without blocking the event loop or tying up a thread.

        Raises:
            AdapterNotFoundError, UnloadTimeoutError: as :meth:`unload`.
            UsageError: with ``tp`` (an unload must agree over the ranks: use :meth:`unload`).
        """
        if self.tp is not None:
            raise UsageError(
                "unload_async is not collective: with tensor parallelism, call unload on each rank"
            )
        await unload_async(self.registry, name, timeout)
        self._forget(name)

    def prefetch(self, names: Iterable[str | None]) -> list[str]:
        """Start reading in the background every adapter of ``names`` that is not in host memory, so that
        steps find them there: pass a scheduler's waiting queue (None entries and repeats are fine);
        returns the names whose reads began, in first-appearance order.

        Never blocks on a read. Each read's host memory is set aside when it begins (the host tier
        evicts idle adapters for it, as a load would); an adapter the host tier cannot make room for now
        (its adapters are all pinned, in a step or being read) is skipped. Names not registered are
        read from ``adapter_dir`` and registered once read. A read that fails is reported to the
        requests of the next step that names the adapter (:attr:`Step.failed`).

        Raises:
            UsageError: ``names`` is a str, or an entry is neither a str nor None.
            AdapterNotFoundError: a name is not registered and there is no ``adapter_dir`` or no folder
                ``adapter_dir/<name>``, or it is being unloaded; nothing started then.
            PathNotAllowedError: as :meth:`discover`.
            LoraPinError: the manager is detached.
            UsageError: the manager loads blocking (``loading="blocking"``, or with ``tp``).
        """
        if not self._wrapped:
            raise LoraPinError("the manager is detached")
        if self.loading != "background":
            raise UsageError(
                "prefetch needs loading='background' (this manager loads blocking"
                + (", as tensor parallelism requires)" if self.tp is not None else ")")
            )
        names = _checked_names(names)
        distinct = [n for n in dict.fromkeys(names) if n is not None]
        new = self._folders([n for n in distinct if n not in self.registry])
        started = self._fetch([n for n in distinct if n not in new])
        started += [
            n for n, folder in new.items() if self._loads.start_discovery(n, folder, self.adapter_dir)
        ]
        order = {n: i for i, n in enumerate(distinct)}
        return sorted(set(started), key=order.__getitem__)

    def wait_loads(self, timeout: float | None = None) -> bool:
        """Block until every background read begun so far has finished (what they read enters the host
        tier at the next step's start); False if some still run after ``timeout`` seconds.

        For warm-up (:meth:`prefetch`, then wait) and tests; a serving loop never needs to wait.
        """
        return self._loads.wait(timeout=timeout)

    def stats(self) -> dict[str, Any]:
        """Counters per tier (hits, misses, loads, evictions, refusals), resident and pinned sets, the
        pool's size in bytes, requests deferred by steps (``deferred_requests``, once per step deferred),
        reads from disk after start-up (``adapter_reads``, taking ``adapter_read_seconds`` in all), and
        of those the reads the background loader ran and installed (``background_loads``), failed
        (``background_load_failures``) and is running now (``loads_in_flight``)."""
        stats = dict(self.registry.stats())
        stats["pool_bytes"] = self.pool.nbytes
        evictions = sorted(self.residency.evictions.items())
        stats["evictions_by_adapter"] = {f"{n}/{tier}": c for (n, tier), c in evictions}
        stats["host_bytes"] = self.residency.host_bytes
        stats["deferred_requests"] = self._deferred_requests
        stats["adapter_reads"] = self.residency.reads
        stats["adapter_read_seconds"] = self.residency.read_seconds
        stats["background_loads"] = self.residency.background_loads
        stats["background_load_failures"] = self._loads.failures
        stats["loads_in_flight"] = len(self._loads.loader.running())
        if self._collectives is not None:
            stats["tp_collective_calls"] = dict(self._collectives.calls)
            stats["tp_collective_bytes"] = dict(self._collectives.nbytes)
        return stats

    # ---- steps ----------------------------------------------------------------------------------

    def prepare_step(self, names: Sequence[str | None], num_tokens: Sequence[int] | int) -> Step:
        """Plan one step of packed tokens and make it the active step.

        ``names[i]`` is request i's adapter (None: the base model) and ``num_tokens[i]`` its tokens this step
        (one int: every request has that many, the fast form for decode steps).
        Requests that do not fit (more distinct adapters than free slots) are deferred, never failed. In
        background loading (the default), so are the requests whose adapter is not in host memory (or
        not registered yet, in ``adapter_dir``): this step starts reading it in the background, and a
        later step admits them once it is read; if the read fails, the next step that names the adapter
        lists its requests in :attr:`Step.failed`. Reads that finished since the last step enter the
        host tier first. The planned copies into device slots are queued before this returns. The model
        then sees ``[T, in]`` inputs whose rows are the admitted requests' tokens in ``admitted`` order;
        call :meth:`finish` when its requests are done.
        On CUDA, the loads and the step's arrays are queued on the current stream without blocking: run the
        forward on that stream (or one that waits for it).

        Raises:
            AdapterNotFoundError: a name is not registered (nor found in ``adapter_dir``; nothing is
                planned). In blocking loading, adapters found there are loaded first, as :meth:`discover`.
            AdapterLoadError: blocking loading only: an adapter evicted from host memory could not be read
                again (or its files changed since it was registered); the step is released and nothing
                else changes.
            UsageError: ``num_tokens`` is a sequence of another length than ``names``.
            StalePlanError: a slot the step would use does not hold what its plan says; nothing ran.
            LoraPinError: a step is already active.
        """
        return self._start(names, num_tokens, per_sequence=False)

    def finish(self, step: Step) -> None:
        """End ``step``: release its requests' adapters and deactivate it.

        Raises:
            LoraPinError: ``step`` is not the active step or was finished already.
            StalePlanError: a slot the step used was written while it ran, so its outputs may have been
                computed with weights that are not their adapter's; the step is ended all the same.
        """
        with self.residency.lock:
            if step is not self._active_step:
                raise LoraPinError(
                    "finish: that step is not the active one (finished already, or another manager's)"
                )
            self._active_step = None
        try:
            # Checked before the release: once the step's adapters are released, an unload may clear
            # their slots.
            changed = self.residency.changed_slots(step._slot_writes)
        finally:
            try:
                # Releases its requests and ends its adapters' protection as "in the step" now, not at
                # the next step: a load between steps may evict them from a full host tier.
                self.registry.finish_step(step._ticket)
            finally:
                self._active = None
                self._step_lock.release()
        if changed:
            raise StalePlanError(
                f"slot(s) {changed} were written while the step using them ran; discard its outputs"
            )

    @contextlib.contextmanager
    def batch(self, names: Sequence[str | None]) -> Iterator[Step]:
        """Run the model on a batch of sequences, sequence i with adapter ``names[i]`` (None: base model).

        Inside the block the model's inputs are ``[B, L]`` with ``B == len(names)`` (any ``L``; prefill then
        decode steps of ``generate`` work). A batch needing more distinct unpinned adapters than free slots is
        refused up front: use :meth:`split` to cut it into batches that fit. The batch waits for the reads
        of its adapters that are not in host memory (in background loading, the loader's threads read
        them; ``adapter_dir`` adapters are read there too).

        Raises:
            CapacityError: the batch does not fit the slots (nothing changes; the message gives the numbers).
            AdapterNotFoundError: as :meth:`prepare_step`.
            AdapterLoadError: an adapter the batch needs could not be read (or its files changed since it
                was registered); nothing of the batch ran.
        """
        step = self._start(names, 1, per_sequence=True)
        try:
            yield step
        finally:
            self.finish(step)

    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """Cut a batch into groups of request indices, in order, each of which fits the slots at once.

        In background loading, ``adapter_dir`` adapters not registered yet are read by the loader (this
        waits for them), and the next step to begin (the first group's, as a rule) prefetches the
        adapters of the groups after the first, so they are read while it runs. Not before it begins:
        reads set aside host memory, and would evict the first group's adapters from a small host tier.

        Raises:
            AdapterNotFoundError, PathNotAllowedError, AdapterLoadError: as :meth:`discover`, for names
                not registered yet.
        """
        if self.loading == "blocking":
            if self.adapter_dir is not None:
                self.discover(names)
            return self.registry.split(names)
        names = _checked_names(names)
        self._discover_waiting(names)
        groups = self.registry.split(names)
        with self.residency.lock:
            self._prefetch_next = [n for group in groups[1:] for i in group if (n := names[i]) is not None]
        return groups

    def detach(self) -> None:
        """Restore the model exactly: every wrapped linear goes back in place. The manager is unusable after.

        Raises:
            LoraPinError: a step is active.
        """
        if not self._step_lock.acquire(blocking=False):
            raise LoraPinError("detach: a step is active; finish it first")
        try:
            detach(self.model, self._wrapped)
            self._wrapped = {}
            self._loads.close()
        finally:
            self._step_lock.release()

    def __repr__(self) -> str:
        return f"LoRAManager(slots={self.pool.slots}, max_rank={self.max_rank}, {self.registry!r})"

    # ---- internals ------------------------------------------------------------------------------

    def _infer_shape(
        self, refs: Sequence[LoRARef], max_rank: int | None, modules: Sequence[str] | str | None
    ) -> tuple[int | None, ModuleSelection | None]:
        """The pool's rank (None: the start-up adapters' largest, once read) and the modules to wrap (None:
        every linear layer, for ``all``): ``modules`` with PEFT's ``target_modules`` meaning, else every
        module a start-up adapter's ``target_modules`` selects (its names or its regex, matched against the
        model's own module keys).

        Raises:
            SpecError: with no start-up adapters, max_rank or modules is missing; max_rank is out of range;
                a regex is refused.
        """
        if modules is not None and not isinstance(modules, str) and list(modules) == ["all"]:
            if max_rank is None and not refs:
                raise SpecError(
                    "with no start-up adapters, max_lora_rank is required to size the slot pool (got "
                    "lora_target_modules=['all'] and max_lora_rank=None)"
                )
            if max_rank is not None and not 1 <= max_rank <= MAX_ADAPTER_RANK:
                raise SpecError(f"max_lora_rank must be in 1..{MAX_ADAPTER_RANK} (got {max_rank})")
            return max_rank, None
        if not refs and (max_rank is None or modules is None):
            raise SpecError(
                "with no start-up adapters, both max_lora_rank and lora_target_modules are required to size "
                f"the slot pool (got max_lora_rank={max_rank}, lora_target_modules={modules})"
            )
        if modules is None:
            selection = ModuleSelection()
            for r in refs:
                config = read_contained_config(r.lora_name, r.lora_path, self._allowed_roots)
                wanted = config.target_modules
                if not isinstance(wanted, str):
                    # By short name, in every layer: adapters loaded later often target other layers.
                    wanted = tuple(t.rsplit(".", 1)[-1] for t in wanted)
                selection = selection.union(ModuleSelection.of(wanted, config.target_parameters))
        else:
            # Names given here also name MoE expert weights (``experts.gate_up_proj``).
            selection = ModuleSelection.of(modules, () if isinstance(modules, str) else modules)
        if max_rank is not None and not 1 <= max_rank <= MAX_ADAPTER_RANK:
            raise SpecError(f"max_lora_rank must be in 1..{MAX_ADAPTER_RANK} (got {max_rank})")
        return max_rank, selection

    def _active_segments(self) -> StepSegments | None:
        return self._active

    def _folders(self, names: list[str]) -> dict[str, Path]:
        """The ``adapter_dir`` folder of each of ``names`` (none registered), by name.

        Raises:
            AdapterNotFoundError: a name is being unloaded, or there is no ``adapter_dir`` or no folder
                ``adapter_dir/<name>``.
            PathNotAllowedError: as :func:`~lora_pin.weights.reader.adapter_dir_for_name`.
        """
        for name in names:
            try:
                self.registry.in_flight(name)  # known though not registered: being unloaded
            except AdapterNotFoundError:
                continue
            raise AdapterNotFoundError(f"adapter {name!r} is being unloaded; it takes no new requests")
        root = self.adapter_dir
        if root is None:
            for name in names:
                self.registry.lora_ref(name)  # raises AdapterNotFoundError, listing what is registered
            return {}
        found: dict[str, Path] = {}
        for name in names:
            directory = adapter_dir_for_name(root, name)
            if directory is None:
                raise AdapterNotFoundError(
                    f"adapter {name!r} is not registered, and {str(root / name)!r} does not exist"
                )
            found[name] = directory
        return found

    def _fetch(self, names: list[str]) -> list[str]:
        """Begin fetching ``names`` (registered) that are not in host memory; the names whose reads began."""
        if not names:
            return []
        fetch = self.registry.prefetch(names)
        self.residency.drop_evicted(fetch.evicted)
        return self._loads.start_fetches(fetch.to_fetch)

    def _forget(self, name: str) -> None:
        self._loads.forget(name)
        self.residency.forget(name)

    def _discover_waiting(self, names: Sequence[str | None]) -> None:
        """Register the ``adapter_dir`` adapters of ``names`` not registered yet, read by the loader; waits.
        All or nothing, as :meth:`discover`.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`_folders`; nothing is read then.
            AdapterLoadError, CapacityError: one of them could not be read or registered; those that were
                are unloaded again.
        """
        found = self._folders([n for n in dict.fromkeys(names) if n is not None and n not in self.registry])
        if not found:
            return
        for name, folder in found.items():
            self._loads.start_discovery(name, folder, self.adapter_dir)
        self._loads.wait(found)
        self._loads.install()
        errors = self._loads.take_errors(found)
        if errors:
            for name, folder in found.items():
                # Only discoveries of these folders go; one a step on another thread has taken up
                # meanwhile stays, as in discover().
                ours = name in self.registry and self.registry.lora_ref(name).lora_path == str(folder)
                if ours and self.registry.in_flight(name) == 0 and self.registry.try_unload(name):
                    self._forget(name)
            raise next(iter(errors.values()))

    def _collectively(self, what: str, do: Any, undo: Any = None) -> None:
        """``do()``; with ``tp``, agreed with every rank (:func:`lora_pin.parallel.collective.agreed`)."""
        if self.tp is None:
            do()
            return
        from lora_pin.parallel.collective import agreed

        agreed(self.tp, what, do, self._collectives, undo)

    def _load_agreed(self, name: str, path: str, pinned: bool) -> LoRARef:
        """:meth:`load` on one tensor-parallel rank: read this rank's shards, agree with every rank, then
        register under the one id rank 0 drew (or refuse on every rank, nothing changed)."""
        from lora_pin.parallel.collective import agreed

        assert self.tp is not None

        def read() -> Any:
            LoRARef.new(name, path, pinned)  # the name and path checks, before anything is read
            if name in self.registry:
                raise DuplicateAdapterError(f"adapter {name!r} is already registered")
            return self.host.read(name, path)

        adapter, agreement = agreed(self.tp, f"load of adapter {name!r}", read, self._collectives)
        ref = LoRARef(name, path, pinned=pinned, lora_id=agreement.token)
        self.residency.add(ref, adapter=adapter)
        return ref

    def _start(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int, *, per_sequence: bool
    ) -> Step:
        if not self._step_lock.acquire(blocking=False):
            raise LoraPinError("a step is already active; finish it before preparing another")
        try:
            if not self._wrapped:
                raise LoraPinError("the manager is detached")
            if not isinstance(names, (list, tuple)):
                names = _checked_names(names)  # read more than once below; a str is refused
            held: _HeldBack | None = None
            if self.loading == "background" and not per_sequence:
                plan, held = self._begin_deferring(names, num_tokens)
            else:
                plan = self._begin(names, num_tokens, per_sequence)
            try:
                slot_writes = self.residency.apply(plan)
                step = self._activate(names, plan, slot_writes, per_sequence, held)
            except BaseException as exc:
                self.registry.finish_step(plan.ticket)
                if isinstance(exc, StalePlanError):
                    # Their occupants are loaded again by the next step that uses them.
                    self.registry.invalidate_slots(exc.stale_slots)
                raise
        except BaseException:
            self._step_lock.release()
            raise
        self._prefetch_split()
        return step

    def _prefetch_split(self) -> None:
        """Prefetch the later groups of the last :meth:`split`, now that a step protects its adapters."""
        if not self._prefetch_next:
            return
        with self.residency.lock:
            names, self._prefetch_next = self._prefetch_next, []
        if names:
            # A hint: an adapter unloaded since the split fails its requests at their own step, not here.
            with contextlib.suppress(LoraPinError):
                self._fetch(list(dict.fromkeys(names)))

    def _begin(self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool) -> Any:
        """One core transaction: admission, slots, loads and the acquisition of every admitted request;
        a per-sequence batch must run whole (CapacityError, nothing changed, if not).

        Adapters the step would read from disk are read first, outside the transaction, so a read that
        fails changes nothing (in background loading by the loader, waited for); should other threads
        evict them again before the step begins (each time), the step reads them itself.
        """
        if self.loading == "background":
            if self.adapter_dir is not None:
                self._discover_waiting(names)
            wanted = [n for n in dict.fromkeys(names) if n is not None]
            for _ in range(_FETCH_FIRST_ATTEMPTS):
                self._loads.install()
                # Begins no step unless every adapter is in host memory; fetches what is not.
                plan = self.registry.begin_step(names, num_tokens, all_or_nothing=per_sequence, fetch=True)
                if plan.ticket is not None:
                    return plan
                self.residency.drop_evicted(n for n, tier, _ in plan.evictions if tier == "host")
                self._loads.start_fetches(plan.to_fetch)
                # With no room for any of its reads, only other reads ending (and installed) make room.
                self._loads.wait(wanted if plan.to_fetch else None)
                # Installed reads stay protected ("fresh") until a plan takes their requests up or
                # leaves them out: the next round's plan, which defers this whole batch, leaves out
                # those of other requests, so their room can go to this batch's reads.
                self._loads.install()
                for error in self._loads.take_errors(wanted).values():
                    raise error
        else:
            if self.adapter_dir is not None:
                self.discover(names)
            for _ in range(_READ_FIRST_ATTEMPTS):
                self._loads.install()
                plan = self.registry.begin_step(
                    names, num_tokens, all_or_nothing=per_sequence, read_first=True
                )
                if plan.ticket is not None:
                    return plan
                self._read_first(plan.to_read)
        # A step's own read takes a fetch's place (its reservation included); the fetch's late result is
        # refused when installed.
        return self.registry.begin_step(names, num_tokens, all_or_nothing=per_sequence)

    def _read_first(self, names: list[str]) -> None:
        """Bring ``names`` (registered, not in host memory) into the host tier before a blocking step
        begins, on this thread; reads the loader is running already are waited for instead. With ``tp``
        every rank reads its own shards, and every rank enters them or every rank fails alike.

        Raises:
            AdapterLoadError: one of them cannot be read (on any rank, with ``tp``), or its files changed
                since it was registered.
        """
        if self.tp is not None:
            self._read_first_agreed(names)
            return
        busy = [n for n in names if self._loads.busy(n)]
        if busy:
            self._loads.wait(busy)
            self._loads.install()
        # A step that reads for itself tries again: a failure of an earlier read is not its answer.
        self._loads.take_errors(names)
        for name in names:
            if name not in busy:
                self.residency.read_into_host(name)

    def _read_first_agreed(self, names: list[str]) -> None:
        # The host tier is part of the plan every rank must agree on: nothing enters it unless every
        # rank read its shards.
        from lora_pin.parallel.collective import agreed

        def read_all() -> list[Any]:
            return [(n, self.residency.read_for_host(n)) for n in names]

        read, _ = agreed(self.tp, f"reading {names}", read_all, self._collectives)
        for name, adapter in read:
            self.residency.enter_host(name, adapter)

    def _begin_deferring(
        self, names: Sequence[str | None], num_tokens: Sequence[int] | int
    ) -> tuple[Any, _HeldBack | None]:
        """The step transaction of background loading: reads finished since the last step enter the host
        tier first; requests whose adapter is not there are deferred, and their reads begin.

        Requests the core never sees: those whose adapter's last read failed (failed now), and those whose
        ``adapter_dir`` adapter is not registered yet (deferred; its read begins).
        """
        self._loads.install()
        held = None
        if self.adapter_dir is not None or self._loads.has_errors:
            held = self._hold_back(names, num_tokens)
        if held is None:
            plan = self.registry.begin_step(names, num_tokens, fetch=True)
        else:
            tokens = num_tokens if isinstance(num_tokens, int) else [num_tokens[i] for i in held.kept]
            plan = self.registry.begin_step([names[i] for i in held.kept], tokens, fetch=True)
            for name, folder in held.new.items():
                self._loads.start_discovery(name, folder, self.adapter_dir)
        self._loads.start_fetches(plan.to_fetch)
        return plan, held

    def _hold_back(self, names: Sequence[str | None], num_tokens: Sequence[int] | int) -> _HeldBack | None:
        """Which requests of ``names`` fail or wait without the core; None when every request goes to it.

        Raises:
            AdapterNotFoundError, PathNotAllowedError: as :meth:`_folders` (nothing changed).
            UsageError: ``num_tokens`` is a sequence of another length than ``names``.
        """
        if not isinstance(num_tokens, int) and len(num_tokens) != len(names):
            raise UsageError(f"num_tokens has {len(num_tokens)} entries but names has {len(names)}")
        distinct = [n for n in dict.fromkeys(names) if n is not None]
        new = self._folders([n for n in distinct if n not in self.registry])
        errors = self._loads.take_errors(distinct)
        if not errors and not new:
            return None
        held = _HeldBack(new={n: f for n, f in new.items() if n not in errors})
        for i, name in enumerate(names):
            if name is None or (name not in errors and name not in new):
                held.kept.append(i)
            elif name in errors:
                held.failed[i] = errors[name]
            else:
                held.waiting.append(i)
        return held

    def _activate(
        self,
        names: Sequence[str | None],
        plan: Any,
        slot_writes: tuple[tuple[int, int], ...],
        per_sequence: bool,
        held: _HeldBack | None,
    ) -> Step:
        dev = self.device
        request_slots = _buffer(plan.request_slots, torch.int32, dev)
        segments = SegmentBatch(
            _buffer(plan.token_perm, torch.int32, dev).long(),
            _buffer(plan.seg_indptr, torch.int32, dev),
            _buffer(plan.seg_slots, torch.int32, dev),
        )
        any_adapter = segments.perm.numel() > 0
        if per_sequence:
            # The plan was made with one token per sequence: its segments serve decode inputs, and the
            # segments of longer inputs are derived from them.
            active = StepSegments(
                segments,
                sequence_slots=request_slots.long(),
                chunk_size=self.chunk_size,
                any_adapter=any_adapter,
            )
        else:
            active = StepSegments(segments=segments, any_adapter=any_adapter)
        admitted, deferred = tuple(plan.admitted), tuple(plan.deferred)
        failed: dict[int, LoraPinError] = {}
        if held is not None:
            # The core saw only the kept requests: its indices are positions among them.
            kept = held.kept
            admitted = tuple(kept[i] for i in admitted)
            deferred = tuple(sorted([kept[i] for i in deferred] + held.waiting))
            failed = held.failed
        loading: tuple[int, ...] = ()
        if deferred and self.loading == "background" and not per_sequence:
            with self.residency.lock:
                # After apply: the host tier holds exactly what the core counts resident.
                loading = tuple(i for i in deferred if (n := names[i]) is not None and n not in self.host)
        step = Step(
            admitted,
            deferred,
            request_slots,
            segments,
            plan.num_tokens,
            plan.ticket,
            slot_writes,
            failed,
            loading,
        )
        with self.residency.lock:
            self._active, self._active_step = active, step
            self._deferred_requests += len(step.deferred)
        return step


@dataclass
class _HeldBack:
    """The requests of a background-loading step that the core does not see, by request index."""

    new: dict[str, Path]
    kept: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    failed: dict[int, LoraPinError] = field(default_factory=dict)


def _loading_mode(loading: str | None, parallel: bool, adapter_dir: bool) -> str:
    """The loading mode a manager runs: ``loading``, or its default (background; blocking with tensor
    parallelism, where every rank must install a read at the same step for their plans to agree).

    Raises:
        SpecError: background loading, or an ``adapter_dir``, asked for with tensor parallelism.
    """
    if not parallel:
        return "background" if loading is None else loading
    if loading == "background":
        raise SpecError(
            "loading='background' is not available with tensor parallelism: each rank's reads would end "
            "at different steps and the ranks' plans would differ; use loading='blocking' (the default "
            "with tp)"
        )
    if adapter_dir:
        raise SpecError(
            "adapter_dir is not available with tensor parallelism: ranks would discover adapters apart; "
            "load each adapter with LoRAManager.load on every rank"
        )
    return "blocking"


def _checked_adapter_dir(
    adapter_dir: str | os.PathLike[str], allowed_roots: tuple[str | os.PathLike[str], ...] | None
) -> Path:
    real = os.path.realpath(adapter_dir)
    if not os.path.isdir(real):
        raise SpecError(f"adapter_dir {os.fspath(adapter_dir)!r} is not a directory")
    if allowed_roots is not None:
        roots = [os.path.realpath(r) for r in allowed_roots]
        if not path_within(real, roots):
            raise SpecError(
                f"adapter_dir {os.fspath(adapter_dir)!r} resolves to {real!r}, outside every allowed "
                f"root {roots}"
            )
    return Path(real)


def _checked_names(names: Iterable[str | None]) -> list[str | None]:
    """``names`` as a list, each a str or None.

    Raises:
        UsageError: ``names`` is a str, or an entry is neither (named by its position).
        SpecError: an entry holds a lone surrogate (``json.loads`` gives one for ``"\ud800"``): it has no
            UTF-8 encoding, so it can name no adapter or folder.
    """
    if isinstance(names, str):
        raise UsageError(f"names must be a sequence of adapter names, got the str {names!r}")
    names = list(names)
    for i, n in enumerate(names):
        if n is not None and not isinstance(n, str):
            raise UsageError(f"names[{i}] must be an adapter name (str) or None, got {type(n).__name__}")
        if n is not None and not n.isascii() and not _is_utf8(n):
            raise SpecError(f"names[{i}] {n!r} is not valid text: it holds a lone surrogate")
    return names


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
