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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
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

__all__ = ["LoRAManager", "Step"]

# How often a step reads adapters evicted from host memory before it begins, should other threads evict
# them again meanwhile; then the step reads them itself.
_READ_FIRST_ATTEMPTS = 2


@dataclass(frozen=True)
class Step:
    """One planned scheduler step (from :meth:`LoRAManager.prepare_step` or :meth:`LoRAManager.batch`).

    Attributes:
        admitted: indices (into the step's requests) of the requests that run this step, in batch order.
        deferred: indices of the requests that must wait for a later step (they hold nothing).
        request_slots: int32 ``[len(admitted)]``, the device slot of each admitted request, -1 for base.
        segments: the token grouping the LoRA layers use; tokens are the admitted requests' tokens,
            each request's contiguous, in ``admitted`` order.
        num_tokens: ``T``, the admitted requests' tokens.
    """

    admitted: tuple[int, ...]
    deferred: tuple[int, ...]
    request_slots: torch.Tensor
    segments: SegmentBatch
    num_tokens: int
    _ticket: int
    _slot_writes: tuple[tuple[int, int], ...] = ()


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
        tp: this process's place in a tensor-parallel group (:class:`lora_pin.parallel.TensorParallel`),
            for a model whose linears are a framework's parallel layers
            (:func:`lora_pin.parallel.register_parallel_linear`): each rank reads and holds only its shard
            of every adapter, and loads (start-up ones included) are collective, every rank of the group
            calling them in the same order (see :mod:`lora_pin.parallel`). ``fully_sharded`` needs
            ``max_lora_rank``. A model cut by transformers' ``tp_plan`` (``DTensor`` weights) is found
            without it.

    Thread safety: loads, unloads, pins and unpins may run from other threads while a step is active. A
    step is one core transaction: its plan and the acquisition of its requests happen at once, so an
    unload of one of its adapters waits for the step to finish, and the name cannot be registered
    again meanwhile. Every write into the device pool and every host-tier change happens under one
    lock (:class:`~lora_pin.model.residency.Residency`), and each step checks that every slot it uses
    holds the contents its plan's slot generation names (:class:`StalePlanError` otherwise), both when it
    starts and when it finishes.

    Raises:
        SpecError: the specs or limits are invalid, the rank/target modules cannot be determined, or
            ``adapter_dir`` is not a folder (or lies outside ``allowed_roots``).
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
        tp: TensorParallel | None = None,
    ) -> None:
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

        Steps call this themselves; call it ahead of time to keep the disk reads out of a step. All or
        nothing: every name is checked before any is read, and if one fails to load, those this call
        loaded are unloaded again (the host tier may still have evicted idle adapters to make room;
        they are read again on demand).

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
        todo = [n for n in dict.fromkeys(names) if n is not None and n not in self.registry]
        if not todo:
            return []
        for name in todo:
            try:
                self.registry.in_flight(name)  # known though not registered: being unloaded
            except AdapterNotFoundError:
                continue
            raise AdapterNotFoundError(f"adapter {name!r} is being unloaded; it takes no new requests")
        root = self.adapter_dir
        if root is None:
            for name in todo:
                self.registry.lora_ref(name)  # raises AdapterNotFoundError, listing what is registered
            return []
        found: list[tuple[str, Path]] = []
        for name in todo:
            directory = adapter_dir_for_name(root, name)
            if directory is None:
                raise AdapterNotFoundError(
                    f"adapter {name!r} is not registered, and {str(root / name)!r} does not exist"
                )
            found.append((name, directory))
        loaded: list[str] = []
        try:
            for name, directory in found:
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
            self.residency.forget(name)

        self._collectively(f"unload of {name!r}", unload)

    async def unload_async(self, name: str, timeout: float | None = None) -> None:
        """:meth:`unload` for asyncio code: polls without blocking the event loop or tying up a thread.

        Raises:
            AdapterNotFoundError, UnloadTimeoutError: as :meth:`unload`.
        """
        await unload_async(self.registry, name, timeout)
        self.residency.forget(name)

    def stats(self) -> dict[str, Any]:
        """Counters per tier (hits, misses, loads, evictions, refusals), resident and pinned sets, the
        pool's size in bytes, requests deferred by steps (``deferred_requests``, once per step deferred),
        and reads from disk after start-up (``adapter_reads``, taking ``adapter_read_seconds`` in all)."""
        stats = dict(self.registry.stats())
        stats["pool_bytes"] = self.pool.nbytes
        evictions = sorted(self.residency.evictions.items())
        stats["evictions_by_adapter"] = {f"{n}/{tier}": c for (n, tier), c in evictions}
        stats["host_bytes"] = self.residency.host_bytes
        stats["deferred_requests"] = self._deferred_requests
        stats["adapter_reads"] = self.residency.reads
        stats["adapter_read_seconds"] = self.residency.read_seconds
        if self._collectives is not None:
            stats["tp_collective_calls"] = dict(self._collectives.calls)
            stats["tp_collective_bytes"] = dict(self._collectives.nbytes)
        return stats

    # ---- steps ----------------------------------------------------------------------------------

    def prepare_step(self, names: Sequence[str | None], num_tokens: Sequence[int] | int) -> Step:
        """Plan one step of packed tokens and make it the active step.

        ``names[i]`` is request i's adapter (None: the base model) and ``num_tokens[i]`` its tokens this step
        (one int: every request has that many, the fast form for decode steps).
        Requests that do not fit (more distinct adapters than free slots) are deferred, never failed. The
        planned loads are done before this returns. The model then sees ``[T, in]`` inputs whose rows are the
        admitted requests' tokens in ``admitted`` order; call :meth:`finish` when its requests are done.
        On CUDA, the loads and the step's arrays are queued on the current stream without blocking: run the
        forward on that stream (or one that waits for it).

        Raises:
            AdapterNotFoundError: a name is not registered (nor found in ``adapter_dir``; nothing is
                planned). Adapters found there are loaded first, as :meth:`discover`.
            AdapterLoadError: an adapter evicted from host memory could not be read again (or its files
                changed since it was registered); the step is released and nothing else changes.
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
        refused up front: use :meth:`split` to cut it into batches that fit.

        Raises:
            CapacityError: the batch does not fit the slots (nothing changes; the message gives the numbers).
            AdapterNotFoundError, AdapterLoadError: as :meth:`prepare_step`.
        """
        step = self._start(names, 1, per_sequence=True)
        try:
            yield step
        finally:
            self.finish(step)

    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """Cut a batch into groups of request indices, in order, each of which fits the slots at once.

        Raises:
            AdapterNotFoundError, PathNotAllowedError, AdapterLoadError: as :meth:`discover`, for names
                not registered yet.
        """
        if self.adapter_dir is not None:
            self.discover(names)
        return self.registry.split(names)

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
                selection = selection.union(ModuleSelection.of(wanted))
        else:
            selection = ModuleSelection.of(modules)
        if max_rank is not None and not 1 <= max_rank <= MAX_ADAPTER_RANK:
            raise SpecError(f"max_lora_rank must be in 1..{MAX_ADAPTER_RANK} (got {max_rank})")
        return max_rank, selection

    def _active_segments(self) -> StepSegments | None:
        return self._active

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
            if self.adapter_dir is not None:
                self.discover(names)
            plan = self._begin(names, num_tokens, per_sequence)
            try:
                slot_writes = self.residency.apply(plan)
                step = self._activate(plan, slot_writes, per_sequence)
            except BaseException as exc:
                self.registry.finish_step(plan.ticket)
                if isinstance(exc, StalePlanError):
                    # Their occupants are loaded again by the next step that uses them.
                    self.registry.invalidate_slots(exc.stale_slots)
                raise
        except BaseException:
            self._step_lock.release()
            raise
        return step

    def _begin(self, names: Sequence[str | None], num_tokens: Sequence[int] | int, per_sequence: bool) -> Any:
        """One core transaction: admission, slots, loads and the acquisition of every admitted request;
        a per-sequence batch must run whole (CapacityError, nothing changed, if not).

        Adapters the step would read from disk are read first, outside the transaction, so a read that
        fails changes nothing; should other threads evict them again before the step begins (twice),
        the step reads them itself.
        """
        for _ in range(_READ_FIRST_ATTEMPTS):
            plan = self.registry.begin_step(names, num_tokens, all_or_nothing=per_sequence, read_first=True)
            if plan.ticket is not None:
                return plan
            if self.tp is None:
                for name in plan.to_read:
                    self.residency.read_into_host(name)
                continue
            # A rank reads its own shards: every rank enters them, or every rank fails the step alike
            # with nothing changed (the host tier is part of the plan every rank must agree on).
            from lora_pin.parallel.collective import agreed

            to_read = list(plan.to_read)

            def read_all(to_read: list[str] = to_read) -> list[Any]:
                return [(n, self.residency.read_for_host(n)) for n in to_read]

            read, _ = agreed(self.tp, f"reading {to_read}", read_all, self._collectives)
            for name, adapter in read:
                self.residency.enter_host(name, adapter)
        return self.registry.begin_step(names, num_tokens, all_or_nothing=per_sequence)

    def _activate(self, plan: Any, slot_writes: tuple[tuple[int, int], ...], per_sequence: bool) -> Step:
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
        step = Step(
            tuple(plan.admitted),
            tuple(plan.deferred),
            request_slots,
            segments,
            plan.num_tokens,
            plan.ticket,
            slot_writes,
        )
        with self.residency.lock:
            self._active, self._active_step = active, step
            self._deferred_requests += len(step.deferred)
        return step


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
