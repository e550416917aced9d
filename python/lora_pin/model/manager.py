"""The manager: one object that serves many LoRA adapters over one Hugging Face-style model.

It ties the pieces together: the Rust registry decides admission, slots, loads and evictions; the host
tier and the device pool hold the tensors; the model's target linears are wrapped with
:class:`~lora_pin.model.layers.LoRALinear`, which run the ``lora_pin`` ops for the active step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lora_pin._core import MAX_SLOTS, LoRARef, LoRARegistry, _checked_names, parse_lora_paths
from lora_pin.args import DEFAULT_MAX_LORAS_PER_BATCH, LoRAConfig, lora_config_from_args, parse_bytes
from lora_pin.errors import AdapterNotFoundError, LoraPinError, SpecError, StalePlanError, UsageError
from lora_pin.model.adapter_dir import checked_adapter_dir
from lora_pin.model.attach import FusedSpec, attach, base_weights, detach, model_targets
from lora_pin.model.leases import RequestLeases
from lora_pin.model.lifecycle import AdapterIdentity, Lifecycle, Placement
from lora_pin.model.reads import (
    DEFAULT_LOAD_TIMEOUT,
    LOADING_MODES,
    BackgroundReads,
    checked_load_timeout,
    loading_mode,
)
from lora_pin.model.residency import Residency
from lora_pin.model.segments import DevicePages, StepSegments, arrays_on
from lora_pin.model.step import Step, StepArrays, step_segments
from lora_pin.model.step_begin import BackgroundLoading, BlockingLoading, Discovery
from lora_pin.ops import CUDA_CHUNK_SIZE
from lora_pin.ops.paged import PageTable
from lora_pin.parallel import TensorParallel
from lora_pin.parallel.api import manager_shard_plan
from lora_pin.unloading import unload_async
from lora_pin.weights import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_TENSORS,
    MAX_ADAPTER_RANK,
    DevicePool,
    HostTier,
    PagedDevicePool,
)
from lora_pin.weights.host_adapter import HostAdapter
from lora_pin.weights.paged_pool import pages_for
from lora_pin.weights.reader import read_contained_config
from lora_pin.weights.shards import GroupCut, ShardPlan
from lora_pin.weights.targets import LoRATargets, ModuleSelection

__all__ = ["LOADING_MODES", "LoRAManager", "Step"]


class LoRAManager:
    """Serves the adapters named by ``lora_paths`` over ``model``, ``max_loras_per_batch`` at a time.

    Args:
        model: a Hugging Face-style causal LM (Llama, Mistral, Qwen2 ...) whose target linears get wrapped.
        lora_paths: start-up adapters, in any form :func:`lora_pin.parse_lora_paths` takes.
        max_loras_per_batch: device slots (distinct adapters one step can use); None: 8 with slots, and
            with pages no bound but the pages (and ``max_loaded_loras``).
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
        max_file_bytes: per-adapter limit on the weight file's bytes (see :mod:`lora_pin.weights.limits`),
            checked before any tensor is read.
        max_tensors: per-adapter limit on the weight file's tensor count, checked likewise.
        loading: ``"background"`` (the default): a step never reads from disk; a request whose adapter
            is not in host memory is deferred while the read pool reads it, and is admitted by a
            later step (with ``tp``, once every rank has read its shards: the ranks agree at each step's
            start). ``"blocking"``: a step reads what it needs before it begins, and every request waits
            for that. :meth:`batch` waits for its reads in either mode (it must run whole).
        load_workers: threads of the read pool (background reads run at once).
        load_timeout: seconds a background read may run (default 300). One still running then (a hung
            disk or network mount) is abandoned: the requests waiting on its adapter fail with an
            :class:`AdapterLoadError` naming the adapter, its path and the deadline (:attr:`Step.failed`,
            or raised by :meth:`batch`), its host memory is given back, a new thread takes its
            worker's place, and whatever it reads, should it ever end, is discarded.
        page_rank: ranks per device page, with ``max_lora_memory``: the device pool is then rank pages
            (:class:`~lora_pin.weights.PagedDevicePool`): an adapter of rank r takes ``ceil(r / page_rank)``
            pages instead of a max-rank slot, so a step holds as many adapters as their pages fit. Not for
            embeddings, MoE expert weights or a fully sharded ``tp`` (refused by name).
        max_lora_memory: the paged pool's device bytes (an int, or a string with a unit: ``"512MiB"``,
            ``"2GB"``), with ``page_rank``; it holds ``max_lora_memory // page_bytes`` pages (one page:
            ``page_rank`` ranks of every target group's A and B and its per-slot entries; see
            ``stats()["page_bytes"]``), and must hold at least one adapter of ``max_lora_rank``.
        tp: this process's place in a tensor-parallel group (:class:`lora_pin.parallel.TensorParallel`),
            for a model whose linears are a framework's parallel layers
            (:func:`lora_pin.parallel.register_parallel_linear`): each rank reads and holds only its shard
            of every adapter, and loads (start-up ones included) are collective, every rank of the group
            calling them in the same order (see :mod:`lora_pin.parallel`). ``fully_sharded`` needs
            ``max_lora_rank``. A model cut by transformers' ``tp_plan`` (``DTensor`` weights) is found
            without it.

    Thread safety: loads, unloads, pins, unpins and prefetches may run from other threads while a step is
    active; background reads run on the read pool's own threads and enter the host tier only at a step's
    start (or while :meth:`batch` / :meth:`split` wait for them). A step is one core transaction: its
    plan and the acquisition of its requests happen at once, so an unload of one of its adapters waits
    for the step to finish, and the name cannot be registered again meanwhile. Every write into the
    device pool and every host-tier change happens under one lock
    (:class:`~lora_pin.model.residency.Residency`), and each step checks that every slot it uses holds the
    contents its plan's slot epoch names (:class:`StalePlanError` otherwise), both when it starts
    and when it finishes.

    Raises:
        SpecError: the specs or limits are invalid, the rank/target modules cannot be determined,
            ``adapter_dir`` is not a folder (or lies outside ``allowed_roots``), ``loading`` is not a mode,
            ``load_workers`` is below 1 or ``load_timeout`` is not a number of seconds above 0; only one of
            ``page_rank`` and ``max_lora_memory`` is given, or ``max_lora_memory`` holds no adapter of the
            pool's rank.
        AdapterLoadError: a start-up adapter cannot be served (the message names it and why); nothing is
            attached then.
        PoolError: the device pool cannot be allocated, or a target cannot be paged (named).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lora_paths: Any = None,
        *,
        max_loras_per_batch: int | None = None,
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
        load_timeout: float = DEFAULT_LOAD_TIMEOUT,
        tp: TensorParallel | None = None,
        page_rank: int | None = None,
        max_lora_memory: int | str | None = None,
    ) -> None:
        if isinstance(load_workers, bool) or not isinstance(load_workers, int) or load_workers < 1:
            raise SpecError(f"load_workers must be an int of at least 1 (got {load_workers!r})")
        load_timeout = checked_load_timeout(load_timeout)
        memory = _paging(page_rank, max_lora_memory)
        if memory is None and max_loras_per_batch is None:
            max_loras_per_batch = DEFAULT_MAX_LORAS_PER_BATCH
        refs = parse_lora_paths(
            lora_paths, max_loras_per_batch=max_loras_per_batch, max_loaded_loras=max_loaded_loras
        )
        self._allowed_roots = None if allowed_roots is None else tuple(allowed_roots)
        self.adapter_dir = (
            None if adapter_dir is None else checked_adapter_dir(adapter_dir, self._allowed_roots)
        )
        rank, modules = self._infer_shape(refs, max_lora_rank, lora_target_modules)
        self._find_targets(model, modules, lora_target_modules, fused_modules, chunk_size)
        shards, self._collective = manager_shard_plan(model, self.targets, self._module_of, tp, rank)
        self.tp = self._collective.tp
        self.loading = loading_mode(loading, self.tp is not None, adapter_dir is not None)
        host = HostTier(
            self.targets,
            max_rank=MAX_ADAPTER_RANK if rank is None else rank,
            dtype=self.dtype,
            allowed_roots=self._allowed_roots,
            allow_pickle=allow_pickle,
            max_file_bytes=max_file_bytes,
            max_tensors=max_tensors,
            shards=shards,
            base_weights=base_weights(model, self.targets, self._module_of),
        )
        startup = self._read_startup(host, refs)
        if rank is None:
            rank = max(a.max_rank for a in startup)
            host.max_rank = rank
        self.max_rank = rank
        self.host = host
        self.pool: DevicePool | PagedDevicePool
        #: The step's page tables on the device (paged pool only).
        self._device_pages: DevicePages | None = None
        paging: dict[str, int] = {}
        if memory is None:
            assert max_loras_per_batch is not None
        else:
            assert page_rank is not None
            pages = _page_count(memory, page_rank, rank, self.targets, self.dtype, shards)
            if max_loras_per_batch is None and max_loaded_loras is not None:
                # A step's adapters are in host memory too: no more of them than the host tier holds.
                max_loras_per_batch = min(pages, max_loaded_loras)
            paging = {"page_rank": page_rank, "max_lora_memory": pages}
        # The core checks the slot or page count (and the rest) before anything is allocated.
        self.registry = LoRARegistry(
            max_loras_per_batch,
            max_loaded_loras,
            max_host_bytes=max_host_bytes,
            eviction_policy=eviction_policy,
            chunk_size=self.chunk_size,
            **paging,
        )
        if memory is None:
            assert max_loras_per_batch is not None
            self.pool = DevicePool(
                self.targets, max_loras_per_batch, rank, self.dtype, self.device, shards=shards
            )
        else:
            assert page_rank is not None
            self.pool = PagedDevicePool(
                self.targets,
                paging["max_lora_memory"],
                page_rank,
                rank,
                self.dtype,
                self.device,
                shards=shards,
            )
            self._device_pages = DevicePages(page_rank, self.device)
        self.residency = Residency(self.registry, host, self.pool)
        self._lifecycle = Lifecycle(self.residency, self._collective)
        #: A server's requests per adapter, from acceptance to their last output: what
        #: :meth:`unload_async` and :meth:`load_async` drain (:mod:`lora_pin.model.leases`).
        self.leases = RequestLeases(self._digest_of)
        self._loads = BackgroundReads(self.residency, self._collective, load_workers, load_timeout)
        self._discovery = Discovery(self.residency, self._loads, self.adapter_dir)
        strategy = BackgroundLoading if self.loading == "background" else BlockingLoading
        self._loading = strategy(self.residency, self._loads, self._discovery, self._collective)
        self._step_lock = threading.Lock()
        self._active: StepSegments | None = None
        self._active_step: Step | None = None
        self._arrays = StepArrays(self.device)
        self._deferred_requests = 0
        self._steps = 0
        self._wrapped: dict[str, torch.nn.Module] = {}
        for r, adapter in zip(refs, startup, strict=True):
            self.residency.add(r, adapter=adapter)
        self._wrapped = attach(
            model,
            self.targets,
            self._module_of,
            self.pool,
            self._active_segments,
            shards,
            self._collective.log,
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
        :func:`lora_pin.lora_config_from_vllm_args`); ``kwargs`` go to the constructor (a
        ``max_loras_per_batch`` there replaces the config's: ``None`` for a paged pool bounded by its pages,
        with ``page_rank`` and ``max_lora_memory``).

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
        # A paged manager may take its own bound on adapters per step (None: the pages'), not the config's.
        slots = kwargs.pop("max_loras_per_batch", config.max_loras_per_batch)
        return cls(
            model,
            list(config.refs),
            max_loras_per_batch=slots,
            max_loaded_loras=config.max_loaded_loras,
            max_lora_rank=config.max_lora_rank,
            lora_target_modules=config.target_modules,
            eviction_policy=config.eviction_policy,
            **kwargs,
        )

    # ---- adapters -------------------------------------------------------------------------------

    def load(
        self, name: str, path: str | os.PathLike[str], *, pinned: bool = False, replace: bool = False
    ) -> LoRARef:
        """Load the adapter at ``path`` as ``name`` (a fresh random id) into the host tier and register it.

        With ``replace``, a registered ``name`` has its weights replaced in place, atomically: the steps
        begun before finish on the old weights, every step begun after this returns uses the new ones;
        its id and pin state stay (``pinned`` applies to a new registration only), its digest and
        generation change (:meth:`identity`). See :mod:`lora_pin.model.lifecycle` for each tier. A name
        not registered is loaded as without ``replace``.

        With ``tp``, every rank calls it: the ranks agree on the read and on the whole adapter's digest
        before any registers (ranks that read different files all refuse it).

        Raises:
            AdapterLoadError: the adapter cannot be served; PathNotAllowedError / UnsafeFormatError likewise.
            DuplicateAdapterError: ``name`` is registered (without ``replace``).
            CapacityError: the host tier is full of adapters that cannot be evicted, pinning would leave
                no slot for unpinned adapters, or (with ``max_host_bytes``) a registered adapter would no
                longer fit in the host tier beside the pinned ones: a pinned load, or a replacement that
                grows a pinned adapter or outgrows the room the pins leave (the rule of :meth:`pin`). In
                every case nothing changes.
        """
        return self._lifecycle.load(name, os.fspath(path), None, None, pinned=pinned, replace=replace)

    def load_tensors(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        config: Any,
        *,
        pinned: bool = False,
        replace: bool = False,
    ) -> LoRARef:
        """Load an adapter handed over in memory as ``name``: :meth:`load` without the files.

        Args:
            tensors: PEFT tensor names (``base_model.model.<module>.lora_A.weight`` ...; what PEFT's
                ``get_peft_model_state_dict`` returns) to tensors of any device (copied to the CPU).
                lora_pin keeps them to read them again after a host-tier eviction; changing them in
                place afterwards makes that read fail (its digest differs) rather than serve them.
            config: ``adapter_config.json``'s fields as a dict, or a PEFT config object.
            pinned: as :meth:`load`.
            replace: as :meth:`load`.

        With ``tp``, every rank calls it with the whole tensors, and keeps its own part.

        Raises:
            AdapterLoadError: exactly where a load of the same files from disk raises it (config fields,
                names, shapes, ranks, NaN/Inf, the ``max_tensors`` / ``max_file_bytes`` limits on the
                tensors' count and bytes), or ``tensors`` is not a mapping of names to dense tensors.
            DuplicateAdapterError, CapacityError: as :meth:`load`. In every case nothing changes.
        """
        return self._lifecycle.load(name, None, tensors, config, pinned=pinned, replace=replace)

    def identity(self, name: str) -> AdapterIdentity:
        """What adapter ``name`` serves now: name, id, content digest and generation
        (:class:`~lora_pin.model.lifecycle.AdapterIdentity`). Put the digest in prefix-cache keys.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.
        """
        return self._lifecycle.identity(name)

    def __contains__(self, name: object) -> bool:
        """Whether an adapter of this name is registered (in any tier, or being read at start-up); what
        an engine asks before it hands a waiting request's adapter to :meth:`prepare_step`."""
        return isinstance(name, str) and name in self.registry

    def placement(self) -> Placement:
        """Where every adapter is (tier, slot, pin, requests in flight, digest, generation) with the free
        slots and the host tier's bytes, as one consistent snapshot
        (:class:`~lora_pin.model.lifecycle.Placement`); cheap enough to poll every second."""
        return self._lifecycle.placement()

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
        return self._discovery.read_now(_checked_names(names))

    def pin(self, name: str) -> None:
        """Keep ``name`` resident in both tiers until :meth:`unpin`.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.
            CapacityError: fewer than one slot would stay for unpinned adapters, or (with ``max_host_bytes``)
                the pinned adapters would overflow the host tier or leave a registered adapter less room
                in it than its bytes (the message has the numbers).

        With ``tp``, every rank calls it; if it fails on any rank it is undone where it succeeded and every
        rank raises.
        """
        self._collective.agreed(
            f"pin of {name!r}", lambda: self.registry.pin(name), lambda: self.registry.unpin(name)
        )

    def unpin(self, name: str) -> None:
        """Make ``name`` evictable again.

        Raises:
            AdapterNotFoundError: ``name`` is not registered.

        With ``tp``, collective as :meth:`pin`.
        """
        self._collective.agreed(
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
            self._loads.forget(name)

        self._collective.agreed(f"unload of {name!r}", unload)

    async def unload_async(self, name: str, timeout: float | None = None) -> None:
        """:meth:`unload` for asyncio code, after ``name``'s leased requests (:attr:`leases`) have ended.

        One drain, in two parts under one ``timeout``: ``name`` first stops taking leases (a server's
        new requests for it are refused) and this waits for its leased requests (queued and running) to
        end, with the adapter still registered, so none of them fails; then the core unregisters it and
        this waits for the step that ran their last tokens, polling without blocking the event loop or
        tying up a thread. Without leases (a library's own loop) only the second part waits.

        Raises:
            AdapterNotFoundError: ``name`` was never registered, or another unload of it is waiting for
                its leases.
            AdapterBusyError: leased requests remain after ``timeout`` seconds; nothing changed (it serves
                on).
            UnloadTimeoutError: as :meth:`unload`, for the time left after the leases ended.
            UsageError: with ``tp`` (an unload must agree over the ranks: use :meth:`unload`).
        """
        if self.tp is not None:
            raise UsageError(
                "unload_async is not collective: with tensor parallelism, call unload on each rank"
            )
        if not self.leases.close(name):
            if self._digest_of(name) is not None:
                raise AdapterNotFoundError(f"adapter {name!r} is being unloaded")
            await unload_async(self.registry, name, timeout)
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.leases.drained(name, timeout, "unload")
            left = None if timeout is None else max(timeout - (loop.time() - started), 0.0)
            await unload_async(self.registry, name, left)
            self._loads.forget(name)
        finally:
            self.leases.reopen(name)

    async def load_async(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        pinned: bool = False,
        replace: bool = False,
        timeout: float | None = None,
    ) -> LoRARef:
        """:meth:`load` for asyncio code, read on a worker thread. A replacement of a registered ``name``
        first holds its new leases (:attr:`leases`) back and waits for its leased requests to end, so
        every request runs on one version's weights; the held requests then get the new ones.

        Raises:
            AdapterBusyError: a replacement whose leased requests did not end within ``timeout`` seconds
                (None: no limit); nothing changed, the old weights serve on.
            AdapterLoadError, DuplicateAdapterError, CapacityError, ...: as :meth:`load`.
        """
        if not (replace and self._digest_of(name) is not None):
            return await asyncio.to_thread(self.load, name, path, pinned=pinned)
        async with self.leases.replacing(name, timeout):
            return await asyncio.to_thread(self.load, name, path, replace=True)

    def _digest_of(self, name: str) -> str | None:
        """``name``'s content digest; None if it is not registered."""
        try:
            return self._lifecycle.identity(name).digest
        except AdapterNotFoundError:
            return None

    def prefetch(self, names: Iterable[str | None]) -> list[str]:
        """Start reading in the background every adapter of ``names`` that is not in host memory, so that
        steps find them there: pass a scheduler's waiting queue (None entries and repeats are fine);
        returns the names whose reads began, in first-appearance order.

        Never blocks on a read. Each read's host memory is set aside when it begins, and idle adapters
        leave the host tier for it only once it has been read (a read that fails evicts nobody); an
        adapter the host tier cannot make room for now (its adapters are all pinned, in a step or being
        read) is skipped. Names not registered are
        read from ``adapter_dir`` and registered once read. A read that fails is reported to the
        requests of the next step that names the adapter (:attr:`Step.failed`).

        Raises:
            UsageError: ``names`` is a str, or an entry is neither a str nor None.
            AdapterNotFoundError: a name is not registered and there is no ``adapter_dir`` or no folder
                ``adapter_dir/<name>``, or it is being unloaded; nothing started then.
            PathNotAllowedError: as :meth:`discover`.
            LoraPinError: the manager is detached.
            UsageError: the manager loads blocking (``loading="blocking"``).

        With ``tp``, every rank calls it with the same names, in the same order relative to its steps and
        loads (each rank starts the same fetches, and returns the same names).
        """
        if not self._wrapped:
            raise LoraPinError("the manager is detached")
        return self._loading.prefetch(names)

    def wait_loads(self, timeout: float | None = None) -> bool:
        """Block until every background read begun so far has finished (what they read enters the host
        tier at the next step's start); False if some still run after ``timeout`` seconds.

        For warm-up (:meth:`prefetch`, then wait) and tests; a serving loop waits with
        :meth:`wait_for_read` instead.
        """
        return self._loads.wait(timeout=timeout)

    def wait_for_read(self, timeout: float | None = None) -> bool:
        """Block until a background read finishes (or fails, or is abandoned at ``load_timeout``): at
        once when one has finished since the last step, or none is in flight. False if none finished
        within ``timeout`` seconds. What it read enters the host tier at the next step's start.

        For a serving loop whose requests all wait for reads (a step admitted nothing, and every
        deferred request is in :attr:`Step.loading`): wait here instead of spinning on empty steps.
        """
        return self._loads.wait_any(timeout)

    def evictions(self) -> dict[tuple[str, str], int]:
        """Evictions so far by ``(adapter, tier)`` (the 256 pairs evicted most, as :meth:`stats`); cheap
        enough to read after every step, to report each eviction when it happens."""
        with self.residency.lock:  # loads on other threads count evictions meanwhile
            return dict(self.residency.evictions)

    def stats(self) -> dict[str, Any]:
        """Counters per tier (hits, misses, loads, evictions, refusals), resident and pinned sets, the
        pool's size in bytes, steps planned (``steps``: :meth:`prepare_step` and its per-sequence form;
        device hits + misses over it are the adapters a step uses), requests deferred by steps
        (``deferred_requests``, once per step deferred),
        reads from disk after start-up (``adapter_reads``, taking ``adapter_read_seconds`` in all), and
        of those the background reads the read pool ran and installed (``background_loads``), failed
        (``background_load_failures``) and is running now (``loads_in_flight``); each adapter's
        ``identities`` (``{name: {"id", "digest", "generation"}}``, see :meth:`identity`) and the slots
        refreshed with an adapter's replaced weights (``slot_refreshes``). Evictions per adapter
        (``evictions_by_adapter``, keyed ``"name/tier"``) list the 256 adapter/tier pairs evicted most;
        ``evictions_by_adapter_others`` counts the rest, so endless adapter names stay bounded. A paged
        pool adds ``page_bytes``, one page's device bytes (the device tier's ``pages`` and ``max_pages``
        count them)."""
        stats = dict(self.registry.stats())
        stats["pool_bytes"] = self.pool.nbytes
        if isinstance(self.pool, PagedDevicePool):
            stats["page_bytes"] = self.pool.page_nbytes
        evictions = sorted(self.residency.evictions.items())
        stats["evictions_by_adapter"] = {f"{n}/{tier}": c for (n, tier), c in evictions}
        stats["evictions_by_adapter_others"] = self.residency.evictions.others
        stats["host_bytes"] = self.residency.host_bytes
        stats["deferred_requests"] = self._deferred_requests
        stats["steps"] = self._steps
        stats["adapter_reads"] = self.residency.reads
        stats["adapter_read_seconds"] = self.residency.read_seconds
        stats["background_loads"] = self.residency.background_loads
        stats["background_load_failures"] = self._loads.failures
        stats["loads_in_flight"] = len(self._loads.pool.running())
        stats["identities"] = {
            name: {"id": i.id, "digest": i.digest, "generation": i.generation}
            for name, i in sorted(self._lifecycle.identities().items())
        }
        stats["slot_refreshes"] = self.residency.refreshes
        stats.update(self._collective.stats())
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
        of its adapters that are not in host memory (in background loading, the read pool's threads read
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

    def offer_order(
        self,
        names: Sequence[str | None],
        overtaken: Sequence[int | None],
        *,
        remaining: Sequence[int | None] | None = None,
        order: str = "arrival",
    ) -> list[int]:
        """The order an engine offers its requests to :meth:`prepare_step` in, as indices into ``names``:
        the core's ranking (``LoRARegistry.offer_order``), the rule admission follows.

        ``order="arrival"``: running requests first, as given; then the waiting ones: overdue (overtaken
        by younger ones in ``OVERDUE_AFTER`` rounds or more, the core's age bound), pinned adapters',
        those that cost no load (the base model's, an adapter's in a device slot), then the rest; each
        rank in the given order. ``order="longest_remaining"``: overdue waiting requests, then those
        that take no device room (the base model's, pinned adapters'), then every other one, running or
        waiting, by ``remaining`` tokens, most first (running before waiting on a tie). Under memory
        pressure that holds the pages of the requests that decide when a batch ends (longest remaining
        processing time first) and lets a nearly finished request sit out a step; the age bound still
        admits every request in time.

        Args:
            names: each request's adapter (None: the base model; a name not registered ranks last).
            overtaken: per request, None when it is running (its sequence started), else the rounds in
                which younger requests started ahead of it (the engine counts them).
            remaining: per request, the tokens it has left to generate (None: no limit); needed for
                ``order="longest_remaining"``.
            order: ``"arrival"`` or ``"longest_remaining"``.

        Raises:
            UsageError: the lengths differ, or ``"longest_remaining"`` without ``remaining``.
            SpecError: an unknown ``order``.
        """
        return self.registry.offer_order(names, overtaken, remaining, order)

    def startable(self, step: Step, waiting: Sequence[bool], *, order: str = "arrival") -> list[int]:
        """The admitted requests of ``step`` an engine starts now (indices, in batch order), given which
        requests were waiting (``waiting[i]``: not started in an earlier step): the core's rule
        (``StepPlan.startable``). With ``order="arrival"`` all of them but, after a waiting request
        deferred for want of a device slot, the waiting ones that use an adapter: so it is not overtaken
        step after step by later requests of its rank; the running ones finish, their slots free up, and
        it is admitted. With ``order="longest_remaining"`` (see :meth:`offer_order`) all of them.

        Raises:
            UsageError: ``waiting`` is not one flag per request of the step.
            SpecError: an unknown ``order``.
        """
        return step._plan.startable(waiting, order)

    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """Cut a batch into groups of request indices, in order, each of which fits the slots at once.

        In background loading, ``adapter_dir`` adapters not registered yet are read on the read pool (this
        waits for them), and the next step to begin (the first group's, as a rule) prefetches the
        adapters of the groups after the first, so they are read while it runs. Not before it begins:
        reads set aside host memory, and would evict the first group's adapters from a small host tier.

        Raises:
            AdapterNotFoundError, PathNotAllowedError, AdapterLoadError: as :meth:`discover`, for names
                not registered yet.
        """
        return self._loading.split(names)

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
        if isinstance(self.pool, PagedDevicePool):
            layout = f"pages={self.pool.pages}, page_rank={self.pool.page_rank}"
        else:
            layout = f"slots={self.pool.slots}"
        return f"LoRAManager({layout}, max_rank={self.max_rank}, {self.registry!r})"

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
        if max_rank is not None and not 1 <= max_rank <= MAX_ADAPTER_RANK:
            raise SpecError(f"max_lora_rank must be in 1..{MAX_ADAPTER_RANK} (got {max_rank})")
        if modules is not None and not isinstance(modules, str) and list(modules) == ["all"]:
            if max_rank is None and not refs:
                raise SpecError(
                    "with no start-up adapters, max_lora_rank is required to size the slot pool (got "
                    "lora_target_modules=['all'] and max_lora_rank=None)"
                )
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
        return max_rank, selection

    def _find_targets(
        self,
        model: torch.nn.Module,
        modules: ModuleSelection | None,
        asked: Sequence[str] | str | None,
        fused_modules: FusedSpec | None,
        chunk_size: int | None,
    ) -> None:
        """Take ``model``'s dtype and device, its LoRA targets for ``modules`` and the chunk size.

        Raises:
            SpecError: ``lora_target_modules`` (``asked``) names modules that select none of its linears.
        """
        param = next(model.parameters())
        self.model = model
        self.dtype, self.device = param.dtype, param.device
        self.chunk_size = CUDA_CHUNK_SIZE if chunk_size is None and self.device.type == "cuda" else chunk_size
        self.targets, self._module_of = model_targets(model, modules, fused_modules)
        if modules is not None and asked is not None:
            missing = modules.unmatched(t.key for t in self.targets.linears)
            if missing:
                raise SpecError(
                    f"lora_target_modules names {missing}, which select none of the model's linear layers "
                    f"(it has {list(self.targets.module_names)})"
                )

    def _read_startup(self, host: HostTier, refs: Sequence[LoRARef]) -> list[HostAdapter]:
        """Read (and check, tensors included) every start-up adapter, before the pool is sized: a config's
        claimed rank alone never sizes it. Over tensor-parallel ranks each rank reads its own shards, and
        all of them start, or none: the ranks agree on every read and on what each read.

        Raises:
            AdapterLoadError (and subclasses): a start-up adapter cannot be served (on any rank).
        """
        startup, _ = self._collective.agreed(
            "start-up adapters", lambda: [host.read(r.lora_name, r.lora_path) for r in refs]
        )
        for r, adapter in zip(refs, startup, strict=True):
            self._collective.agree_identity(
                f"start-up adapter {r.lora_name!r}", adapter.digest, adapter.whole_nbytes
            )
        return [self._collective.finish_read(adapter) for adapter in startup]

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
            plan = self._loading.begin(names, num_tokens, per_sequence)
            try:
                device_pages = self._device_pages
                if device_pages is None:
                    slot_writes = self.residency.apply(plan)
                    pages = None
                else:
                    tables = (plan.page_indptr, plan.page_table)
                    slot_writes = self.residency.apply(plan, tables)
                    pages = device_pages.of(*tables)
                step = self._activate(names, plan, slot_writes, per_sequence, pages)
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

    def _activate(
        self,
        names: Sequence[str | None],
        plan: Any,
        slot_writes: tuple[tuple[int, int], ...],
        per_sequence: bool,
        pages: PageTable | None,
    ) -> Step:
        request_slots, segments, any_adapter = self._arrays.of(plan)
        if per_sequence:
            active = step_segments(request_slots, segments, any_adapter, self.chunk_size, pages)
        else:
            active = StepSegments(segments, None, None, any_adapter, pages)
        admitted, deferred, reasons, failed, num_tokens = plan.outcome()
        step = Step(
            admitted,
            deferred,
            request_slots,
            segments,
            num_tokens,
            plan,
            slot_writes,
            self._loading.failures(names, failed) if failed else None,
            self._loading.waiting_for_reads(deferred, reasons) if deferred else (),
            reasons,
        )
        with self.residency.lock:
            self._active, self._active_step = active, step
            self._deferred_requests += len(deferred)
            self._steps += 1
        return step

    def run_subset(self, step: Step, requests: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Run only ``requests`` of the active ``step``, in this order, ``num_tokens[k]`` tokens for
        ``requests[k]``: for an engine that admits with :meth:`prepare_step` and then schedules, under its
        own token and memory budgets, a subset of the admitted requests (a prefill split over steps, a
        request left for the next step). The model then sees ``[sum(num_tokens), in]`` rows, each request's
        contiguous, in ``requests`` order; the admitted requests left out run nothing and are released by
        :meth:`finish` with the rest. May be called again before the forward to change the subset.

        Raises:
            LoraPinError: ``step`` is not the active step.
            UsageError: ``requests`` and ``num_tokens`` differ in length, an index is not among
                ``step.admitted`` or repeats, or a count is below 1. Nothing changes then.
        """
        # The core checks the sub-batch (nothing changes on an error) and segments it.
        data, words = step._plan.subset(requests, num_tokens)
        _, segments = arrays_on(data, words, self.device)
        with self.residency.lock:
            if step is not self._active_step:
                raise LoraPinError("run_subset: that step is not the active one (finished already?)")
            pages = None if self._active is None else self._active.pages
            self._active = StepSegments(segments=segments, any_adapter=words[0] > 0, pages=pages)


def _paging(page_rank: int | None, max_lora_memory: int | str | None) -> int | None:
    """The paged pool's bytes, or None for slots.

    Raises:
        SpecError: only one of the two is given, ``page_rank`` is not an int of at least 1, or
            ``max_lora_memory`` is not a positive number of bytes.
    """
    if page_rank is None and max_lora_memory is None:
        return None
    if page_rank is None or max_lora_memory is None:
        raise SpecError(
            f"page_rank and max_lora_memory go together (got page_rank={page_rank!r}, "
            f"max_lora_memory={max_lora_memory!r})"
        )
    if isinstance(page_rank, bool) or not isinstance(page_rank, int) or page_rank < 1:
        raise SpecError(f"page_rank must be an int of at least 1 (got {page_rank!r})")
    return parse_bytes("max_lora_memory", max_lora_memory)


def _page_count(
    memory: int,
    page_rank: int,
    rank: int,
    targets: LoRATargets,
    dtype: torch.dtype,
    shards: ShardPlan[GroupCut],
) -> int:
    """The pages ``memory`` bytes hold for a paged pool over ``targets`` (this rank's ``shards``).

    Raises:
        SpecError: they hold no adapter of the pool's ``rank``, or more pages than a pool may have.
    """
    page_bytes = PagedDevicePool.page_bytes(targets, page_rank, dtype, shards)
    pages = memory // page_bytes
    needs = pages_for(rank, page_rank)
    if pages < needs:
        raise SpecError(
            f"max_lora_memory={memory} bytes holds {pages} page(s) of {page_bytes} bytes "
            f"(page_rank={page_rank} over {len(targets.groups)} target groups), but an adapter "
            f"of the pool's rank {rank} needs {needs}: raise max_lora_memory to at least "
            f"{needs * page_bytes} bytes"
        )
    if pages > MAX_SLOTS:
        raise SpecError(
            f"max_lora_memory={memory} bytes holds {pages} pages of {page_bytes} bytes, past the "
            f"{MAX_SLOTS} a pool may have: give at most {MAX_SLOTS * page_bytes} bytes, or a larger "
            "page_rank"
        )
    return pages
