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
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_pin._core import LoRARef, LoRARegistry, parse_lora_paths
from lora_pin.args import DEFAULT_MAX_LORAS_PER_BATCH, lora_config_from_args
from lora_pin.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    CapacityError,
    DuplicateAdapterError,
    LoraPinError,
    SpecError,
    StalePlanError,
    UsageError,
)
from lora_pin.model.attach import FusedSpec, attach, detach, model_targets
from lora_pin.model.layers import StepSegments
from lora_pin.ops import CUDA_CHUNK_SIZE, SegmentBatch
from lora_pin.registry import unload_async
from lora_pin.weights import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_TENSORS,
    DEFAULT_TARGET_MODULES,
    MAX_ADAPTER_RANK,
    DevicePool,
    HostTier,
)
from lora_pin.weights.reader import adapter_dir_for_name, path_within, read_contained_config

__all__ = ["LoRAManager", "Step"]


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
    _ids: tuple[str | None, ...]
    _slot_writes: tuple[tuple[int, int], ...] = ()


def _buffer(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer from the core as a tensor on ``device`` (no Python loop; empty buffers allowed)."""
    view = memoryview(data)
    if view.nbytes == 0:
        return torch.empty(0, dtype=dtype, device=device)
    host = torch.frombuffer(bytearray(view), dtype=dtype)
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
        max_lora_rank: the slot pool's rank; None takes the largest start-up adapter's.
        lora_target_modules: module names to wrap; None (or ``["all"]``) takes every supported module the
            start-up adapters use (all of ``q/k/v/o, gate/up/down`` when one uses a regex).
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

    Thread safety: loads, unloads, pins and unpins may run from other threads while a step is active. Every
    write into the device pool and every host-tier change happens under one lock, and each step checks that
    every slot it uses holds the contents its plan's slot generation names (:class:`StalePlanError`
    otherwise), both when it starts and when it finishes.

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
        lora_target_modules: Sequence[str] | None = None,
        eviction_policy: str = "lru",
        max_host_bytes: int | None = None,
        allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
        adapter_dir: str | os.PathLike[str] | None = None,
        allow_pickle: bool = False,
        chunk_size: int | None = None,
        fused_modules: FusedSpec | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_tensors: int = DEFAULT_MAX_TENSORS,
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
        if lora_target_modules is not None and list(lora_target_modules) != ["all"]:
            found = {t.module for t in self.targets.linears}
            missing = [m for m in lora_target_modules if m not in found]
            if missing:
                raise SpecError(
                    f"lora_target_modules names {missing}, which the model has no linear layer for inside "
                    f"a numbered layer (it has {sorted(found)})"
                )
        self.max_rank = rank
        self.chunk_size = chunk_size
        self.pool = DevicePool(self.targets, max_loras_per_batch, rank, self.dtype, self.device)
        self.host = HostTier(
            self.targets,
            max_rank=rank,
            dtype=self.dtype,
            allowed_roots=self._allowed_roots,
            allow_pickle=allow_pickle,
            max_file_bytes=max_file_bytes,
            max_tensors=max_tensors,
        )
        self.registry = LoRARegistry(
            max_loras_per_batch,
            max_loaded_loras,
            max_host_bytes=max_host_bytes,
            eviction_policy=eviction_policy,
            chunk_size=chunk_size,
        )
        # Per registered adapter: its path, and the folder it is confined to when discovered.
        self._paths: dict[str, tuple[str, Path | None]] = {}
        self._evictions: Counter[tuple[str, str]] = Counter()
        self._step_lock = threading.Lock()
        # Guards the host tier's dict, the pool's writes and the bookkeeping below against other threads.
        self._tier_lock = threading.RLock()
        # Per slot: (registry slot generation, pool write count) right after the manager filled it.
        self._filled: list[tuple[int, int] | None] = [None] * max_loras_per_batch
        self._active: StepSegments | None = None
        self._active_step: Step | None = None
        self._wrapped: dict[str, torch.nn.Module] = {}
        for r in refs:
            self._load_ref(r)
        self._wrapped = attach(model, self.targets, self._module_of, self.pool, self._active_segments)

    @classmethod
    def from_args(cls, model: torch.nn.Module, namespace: argparse.Namespace, **kwargs: Any) -> LoRAManager:
        """A manager configured from the server args :func:`lora_pin.add_lora_args` added and parsed.

        Raises:
            SpecError, AdapterLoadError, PoolError: as the constructor.
        """
        cfg = lora_config_from_args(namespace)
        return cls(
            model,
            list(cfg.refs),
            max_loras_per_batch=cfg.max_loras_per_batch,
            max_loaded_loras=cfg.max_loaded_loras,
            max_lora_rank=cfg.max_lora_rank,
            lora_target_modules=cfg.target_modules,
            eviction_policy=cfg.eviction_policy,
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
        ref = LoRARef.new(name, os.fspath(path), pinned)
        self._load_ref(ref)
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
                    self._load_ref(LoRARef.new(name, str(directory), False), root=root)
                except DuplicateAdapterError:
                    continue  # registered meanwhile by another thread: theirs stands
                loaded.append(name)
        except BaseException:
            for name in loaded:
                # A step on another thread may have taken it up meanwhile: then it stays (it loaded
                # fine), rather than be torn down under that step.
                if self.registry.in_flight(name) == 0 and self.registry.try_unload(name):
                    self._forget(name)
            raise
        return loaded

    def pin(self, name: str) -> None:
        """Keep ``name`` resident in both tiers until :meth:`unpin`.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.
            CapacityError: fewer than one slot would stay for unpinned adapters (the message has the numbers).
        """
        self.registry.pin(name)

    def unpin(self, name: str) -> None:
        """Make ``name`` evictable again.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.
        """
        self.registry.unpin(name)

    def unload(self, name: str, timeout: float | None = None) -> None:
        """Unregister ``name`` (no new requests), wait for its running requests, then free its weights.

        Idempotent for a name that was registered.

        Raises:
            AdapterNotFoundError: ``name`` was never registered.
            UnloadTimeoutError: requests still use it after ``timeout`` seconds (it stays unregistered).
        """
        self.registry.unload(name, timeout)
        self._forget(name)

    async def unload_async(self, name: str, timeout: float | None = None) -> None:
        """:meth:`unload` for asyncio code: polls without blocking the event loop or tying up a thread.

        Raises:
            AdapterNotFoundError, UnloadTimeoutError: as :meth:`unload`.
        """
        await unload_async(self.registry, name, timeout)
        self._forget(name)

    def stats(self) -> dict[str, Any]:
        """Counters per tier (hits, misses, loads, evictions, refusals), resident and pinned sets, and the
        pool's size in bytes."""
        stats = dict(self.registry.stats())
        stats["pool_bytes"] = self.pool.nbytes
        stats["evictions_by_adapter"] = {f"{n}/{tier}": c for (n, tier), c in sorted(self._evictions.items())}
        with self._tier_lock:
            stats["host_bytes"] = self.host.nbytes
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
            AdapterLoadError: an adapter evicted from host memory could not be read again; the step is
                released and nothing else changes.
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
        with self._tier_lock:
            if step is not self._active_step:
                raise LoraPinError(
                    "finish: that step is not the active one (finished already, or another manager's)"
                )
            self._active_step = None
            # Checked before the release: once the step's adapters are released, an unload may clear
            # their slots.
            counts = self.pool.write_counts()
            changed = [slot for slot, writes in step._slot_writes if counts[slot] != writes]
        try:
            self.registry.release(list(step._ids))
        finally:
            try:
                # Its adapters stop being protected as "in the step" now, not at the next plan: a load
                # between steps may evict them from a full host tier.
                self.registry.end_step()
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
        return self._split(names)

    def _split(self, names: Sequence[str | None]) -> list[list[int]]:
        pinned = self._pinned()
        budget = self.pool.slots - len(pinned)
        groups: list[list[int]] = []
        current: list[int] = []
        distinct: set[str] = set()
        for i, name in enumerate(names):
            if name is not None:
                self.registry.lora_ref(name)
            if name is not None and name not in pinned and name not in distinct and len(distinct) == budget:
                groups.append(current)
                current, distinct = [], set()
            if name is not None and name not in pinned:
                distinct.add(name)
            current.append(i)
        if current:
            groups.append(current)
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
        finally:
            self._step_lock.release()

    def __repr__(self) -> str:
        return f"LoRAManager(slots={self.pool.slots}, max_rank={self.max_rank}, {self.registry!r})"

    # ---- internals ------------------------------------------------------------------------------

    def _infer_shape(
        self, refs: Sequence[LoRARef], max_rank: int | None, modules: Sequence[str] | None
    ) -> tuple[int, tuple[str, ...]]:
        if modules is not None and list(modules) == ["all"]:
            modules = None
        if refs and (max_rank is None or modules is None):
            ranks: list[int] = []
            names: set[str] = set()
            regex = False
            for r in refs:
                config = read_contained_config(r.lora_name, r.lora_path, self._allowed_roots)
                ranks.append(max([config.r, *config.rank_pattern.values()]))
                if isinstance(config.target_modules, str):
                    regex = True
                else:
                    names.update(t.rsplit(".", 1)[-1] for t in config.target_modules)
            if max_rank is None:
                max_rank = max(ranks)
            if modules is None:
                modules = DEFAULT_TARGET_MODULES if regex else tuple(sorted(names))
        if max_rank is None or modules is None:
            raise SpecError(
                "with no start-up adapters, both max_lora_rank and lora_target_modules are required to size "
                f"the slot pool (got max_lora_rank={max_rank}, lora_target_modules={modules})"
            )
        if not 1 <= max_rank <= MAX_ADAPTER_RANK:
            raise SpecError(f"max_lora_rank must be in 1..{MAX_ADAPTER_RANK} (got {max_rank})")
        return max_rank, tuple(modules)

    def _load_ref(self, ref: LoRARef, root: Path | None = None) -> None:
        # Read outside the lock (it can take long); registering, holding the weights and dropping the
        # victims happen at once under it, so two threads loading one name cannot drop each other's copy.
        adapter = self.host.read(ref.lora_name, ref.lora_path, root=root)
        with self._tier_lock:
            # Raises for a name registered or still draining (its weights are in use).
            evicted = self.registry.register(
                ref,
                rank=adapter.max_rank,
                host_bytes=adapter.nbytes,
                device_bytes=self.pool.slot_nbytes,
            )
            # Weights still held under the name belong to a registration an unload has just forgotten
            # (its _forget has not run yet): stale, replaced.
            self._drop_host(ref.lora_name)
            self.host.add(adapter)
            for name in evicted:
                self._evictions[(name, "host")] += 1
                self._drop_host(name)
            self._paths[ref.lora_name] = (ref.lora_path, root)

    def _drop_host(self, name: str) -> None:
        if name in self.host:
            self.host.drop(name)

    def _forget(self, name: str) -> None:
        """Free what the manager holds for ``name`` once the registry has forgotten it."""
        with self._tier_lock:
            if name in self.registry:
                return  # registered again since the unload: what is held is the new adapter's
            self._drop_host(name)
            self._paths.pop(name, None)
            for slot in range(self.pool.slots):
                if self.pool.occupant(slot) == name:
                    self.pool.clear(slot)
                    self._filled[slot] = None

    def _active_segments(self) -> StepSegments | None:
        return self._active

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
            if per_sequence and len(self._split(names)) > 1:
                raise CapacityError(self._too_many(names))
            plan = self.registry.plan(names, num_tokens)
            admitted_names = [names[i] for i in plan.admitted]
            try:
                ids = tuple(self.registry.acquire(admitted_names))
            except BaseException:
                # An admitted adapter was unloaded between plan and acquire: no planned load may stay
                # pending, or a later plan would take its never-filled slot for resident.
                self._abandon(plan.loads)
                raise
            slot_writes = self._apply(plan, ids, admitted_names)
            if per_sequence and plan.deferred:
                # The host tier could not make room (its adapters are all in use): nothing ran yet.
                self.registry.release(list(ids))
                raise CapacityError(self._too_many(names))
            try:
                step = self._activate(plan, ids, slot_writes, per_sequence)
            except BaseException:
                self.registry.release(list(ids))
                raise
        except BaseException:
            self._step_lock.release()
            raise
        return step

    def _activate(
        self,
        plan: Any,
        ids: tuple[str | None, ...],
        slot_writes: tuple[tuple[int, int], ...],
        per_sequence: bool,
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
            active = StepSegments(
                sequence_slots=request_slots.long(), chunk_size=self.chunk_size, any_adapter=any_adapter
            )
            # The plan was made with one token per sequence: its segments already serve decode inputs.
            active._by_length[1] = segments
        else:
            active = StepSegments(segments=segments, any_adapter=any_adapter)
        step = Step(
            tuple(plan.admitted),
            tuple(plan.deferred),
            request_slots,
            segments,
            plan.num_tokens,
            ids,
            slot_writes,
        )
        with self._tier_lock:
            self._active, self._active_step = active, step
        return step

    def _pinned(self) -> set[str]:
        return set(self.registry.stats()["host"]["pinned"])

    def _too_many(self, names: Sequence[str | None]) -> str:
        pinned = self._pinned()
        distinct = {n for n in names if n is not None and n not in pinned}
        return (
            f"a batch of {len(names)} sequences uses {len(distinct)} distinct unpinned adapters but "
            f"{self.pool.slots} slots minus {len(pinned)} pinned leave room for "
            f"{self.pool.slots - len(pinned)}; use LoRAManager.split(names) to cut it into batches that fit"
        )

    def _abandon(self, loads: Sequence[tuple[str, str, int, str]]) -> None:
        for name, _lora_id, _slot, _source in loads:
            # An adapter unloaded meanwhile is forgotten with its slot: nothing is pending for it.
            with contextlib.suppress(AdapterNotFoundError):
                self.registry.load_failed(name)

    def _apply(
        self, plan: Any, ids: tuple[str | None, ...], plan_names: Sequence[str | None]
    ) -> tuple[tuple[int, int], ...]:
        """Perform the plan's evictions and loads; return ``(slot, pool writes)`` of every slot the step
        uses, after checking each holds what the plan's slot generation says."""
        generations = memoryview(plan.slot_generations).cast("q")
        with self._tier_lock:
            for name, tier, _slot in plan.evictions:
                self._evictions[(name, tier)] += 1
                if tier == "host":
                    self._drop_host(name)
            loads = list(plan.loads)
            for done, (name, _lora_id, slot, source) in enumerate(loads):
                try:
                    if source == "disk" or name not in self.host:
                        path, root = self._paths[name]
                        self.host.load(name, path, root=root)
                    self.pool.fill(slot, self.host[name])
                except BaseException as exc:
                    # The slot may be half written: empty it, so no later step can read the remains.
                    self._filled[slot] = None
                    self.pool.clear(slot)
                    self._abandon(loads[done:])
                    self.registry.release(list(ids))
                    if isinstance(exc, LoraPinError):
                        raise
                    raise AdapterLoadError(
                        f"adapter {name!r}: loading into slot {slot} failed: {exc!r}"
                    ) from exc
                self._filled[slot] = (generations[slot], self.pool.writes(slot))
                self.registry.load_done(name)
            used = sorted(set(memoryview(plan.request_slots).cast("i")) - {-1})
            counts = self.pool.write_counts()
            stale = [s for s in used if self._filled[s] != (generations[s], counts[s])]
            if stale:
                self.registry.release(list(ids))
                # Mark the stale slots' adapters not resident, so the next plan loads them again.
                slots = memoryview(plan.request_slots).cast("i")
                owners = {slots[i]: plan_names[i] for i in range(len(slots)) if slots[i] in stale}
                for name in filter(None, owners.values()):
                    with contextlib.suppress(AdapterNotFoundError, UsageError):
                        self.registry.load_failed(name)
                raise StalePlanError(
                    f"the step's plan names slot generation(s) "
                    f"{ {s: generations[s] for s in stale} } but the pool holds "
                    f"{ {s: self._filled[s] for s in stale} } (generation, writes) there; no step ran"
                )
            return tuple((s, counts[s]) for s in used)


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
