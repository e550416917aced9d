"""The host tier: adapters validated against the model and normalised into CPU tensors per target group.

:func:`load_adapter` (and :func:`load_opened`, for an adapter already opened) reads one adapter into a
:class:`~lora_pin.weights.host_adapter.HostAdapter`: the checks against the model
(:mod:`lora_pin.weights.model_checks`), then, for a plain adapter, a recipe decided from its header and kept
for the next adapter trained alike (:mod:`lora_pin.weights.read_recipes`): one read of every tensor into its
place; for any other, its host modules built one by one (:mod:`lora_pin.weights.building`).
:class:`HostTier` holds the adapters loaded, by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch

from lora_pin.errors import AdapterLoadError, AdapterNotFoundError, DuplicateAdapterError
from lora_pin.weights.building import (
    _build_module,
    _group_numel,
    _host_modules,
    _refuse_non_finite,
    _served,
    _whole_numel,
    _with_factors,
)
from lora_pin.weights.digest import adapter_digest
from lora_pin.weights.dora import BaseWeights
from lora_pin.weights.host_adapter import HostAdapter, HostModule, _Slab, _whole_dora_nbytes
from lora_pin.weights.limits import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_TENSORS
from lora_pin.weights.model_checks import _check_against_model, _listing
from lora_pin.weights.read_recipes import _ReadRecipe, _recipes
from lora_pin.weights.reader import AdapterFile, LoraTensorPair, open_adapter
from lora_pin.weights.shards import WHOLE, GroupCut, ShardPlan
from lora_pin.weights.targets import LoRATargets
from lora_pin.weights.tensors import AdapterTensors

__all__ = ["HostAdapter", "HostModule", "HostTier", "load_adapter", "load_opened"]


def load_adapter(
    name: str,
    path: str | os.PathLike[str],
    targets: LoRATargets,
    *,
    max_rank: int,
    dtype: torch.dtype,
    allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
    allow_pickle: bool = False,
    pin_memory: bool | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
    shards: ShardPlan[GroupCut] = WHOLE,
    base_weights: BaseWeights | None = None,
) -> HostAdapter:
    """Read, validate and normalise the PEFT adapter at ``path`` into host tensors for ``targets``.

    Every check runs before any host tensor is built, and nothing outside the returned object changes, so a
    failure leaves the caller's state as it was. ``pin_memory`` defaults to ``torch.cuda.is_available()``.
    Tensor shapes: per touched group A ``[n_slices * rank, in]``, B ``[out_total, rank]``
    (see :class:`HostModule`). ``shards`` says which part of each tensor to keep
    (:class:`~lora_pin.weights.shards.ShardPlan`): the whole of it by default; on a tensor-parallel rank the
    stored tensors are checked at their unsharded shapes and only this rank's part of each is read from
    the file and kept. A DoRA adapter's factors
    (:mod:`lora_pin.weights.dora`) are computed against ``base_weights`` (group key -> the model's base
    weight ``[out_total, in]``, on its device), once; without it they are left None (the adapter is then
    for inspection, not for a device pool).

    Raises:
        PathNotAllowedError: ``path`` (or a file in it) resolves outside ``allowed_roots``, or has ``..``.
        UnsafeFormatError: the weights are ``adapter_model.bin`` and ``allow_pickle`` is False.
        AdapterLoadError: a refused config field (DoRA, bias, modules_to_save, non-LORA ...), a target
            module the model lacks, a rank above ``max_rank`` or different from the config's, a tensor shape
            that does not fit its module, tensors matching no module, any unused tensor, or a targeted module
            without tensors; a weight file above ``max_file_bytes`` or with more than ``max_tensors``
            tensors (checked before any tensor is read); a NaN/Inf weight in the serving dtype; a weight
            file that changed while it was read; for a DoRA adapter, a missing, misshapen or non-finite
            magnitude, DoRA on an embedding or under tensor parallelism, a layer without a plain base
            weight, or a non-finite factor. Messages name the adapter, the file and the field or tensor.
    """
    if not dtype.is_floating_point:
        raise AdapterLoadError(f"adapter {name!r}: serving dtype must be floating point, got {dtype}")
    with open_adapter(
        name,
        path,
        allowed_roots=allowed_roots,
        allow_pickle=allow_pickle,
        max_file_bytes=max_file_bytes,
        max_tensors=max_tensors,
    ) as file:
        return load_opened(
            file,
            targets,
            max_rank=max_rank,
            dtype=dtype,
            pin_memory=pin_memory,
            shards=shards,
            base_weights=base_weights,
        )


def load_opened(
    file: AdapterFile,
    targets: LoRATargets,
    *,
    max_rank: int,
    dtype: torch.dtype,
    pin_memory: bool | None = None,
    shards: ShardPlan[GroupCut] = WHOLE,
    base_weights: BaseWeights | None = None,
) -> HostAdapter:
    """:func:`load_adapter` of an adapter already opened (:func:`~lora_pin.weights.reader.open_adapter`,
    or :meth:`~lora_pin.weights.reader.AdapterFile.in_memory` for tensors handed over in memory): the same
    checks, the same errors, and its digest.

    Raises:
        AdapterLoadError: as :func:`load_adapter`.
    """
    name = file.name
    if not dtype.is_floating_point:
        raise AdapterLoadError(f"adapter {name!r}: serving dtype must be floating point, got {dtype}")
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    recipes = _recipes(targets)
    recipe_key = (
        None if file.layout_key is None or shards.parallel else (*file.layout_key, max_rank, dtype, pin)
    )
    recipe = None if recipe_key is None else recipes.get(recipe_key)
    if recipe is None:
        ranks, pairs = _check_against_model(file, targets, max_rank, shards)
        recipe = None if recipe_key is None else _ReadRecipe.decide(file, targets, ranks, pairs, dtype, pin)
        if recipe is None:
            return _build(file, targets, ranks, pairs, dtype, pin, shards, base_weights)
        recipes.put(recipe_key, recipe)
    return recipe.load(file, targets, dtype)


def _build(
    file: AdapterFile,
    targets: LoRATargets,
    ranks: dict[str, int],
    pairs: dict[str, LoraTensorPair],
    dtype: torch.dtype,
    pin: bool,
    shards: ShardPlan[GroupCut],
    base_weights: BaseWeights | None,
) -> HostAdapter:
    """The :class:`HostAdapter` of ``file``, whose checks against the model gave ``ranks`` and ``pairs``,
    built module by module (:mod:`lora_pin.weights.building`): a load no recipe covers (zero padding,
    another stored dtype, DoRA, expert weights, a tensor-parallel rank's part, tensors in memory)."""
    touched = [g for g in targets.groups if any(m.key in ranks for m in g.members)]
    slab = _Slab(sum(_group_numel(g, ranks, shards) for g in touched), dtype, pin)
    reads: list[tuple[str, torch.Tensor]] = []
    built = [_build_module(file, g, ranks, pairs, slab, reads, shards) for g in touched]
    searched = list(zip(reads, file.read_many(reads), strict=True))
    modules = _host_modules(file, pairs, built, pin, shards)
    _refuse_non_finite(file, pairs, slab, modules.values(), searched, 2 * len(ranks))
    if file.config.use_dora and base_weights is not None:
        modules = _with_factors(file, modules, base_weights, shards)
    file.check_unchanged()
    digest = adapter_digest(file.digests.result(), _served(modules.values(), pairs))
    whole = sum(_whole_numel(g, ranks, shards) for g in touched) * slab.memory.element_size()
    whole += sum(_whole_dora_nbytes(m, shards) for m in modules.values())
    return HostAdapter(
        file.name, file.directory, file.config, targets, dtype, modules, 2 * len(ranks), digest, whole
    )


class HostTier:
    """The adapters held in host memory, by name; :meth:`load` adds one only if it loads completely.

    Which adapters stay is decided by the Rust core; this class only holds their tensors. ``max_file_bytes``
    and ``max_tensors`` are the per-adapter limits of :func:`load_adapter`; with ``shards`` (a
    tensor-parallel rank's shard plan) it reads and holds only this rank's part of each adapter. With
    ``base_weights`` (the model's, see :func:`load_adapter`) the DoRA adapters it reads get their factors.
    """

    def __init__(
        self,
        targets: LoRATargets,
        *,
        max_rank: int,
        dtype: torch.dtype,
        allowed_roots: Iterable[str | os.PathLike[str]] | None = None,
        allow_pickle: bool = False,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_tensors: int = DEFAULT_MAX_TENSORS,
        shards: ShardPlan[GroupCut] = WHOLE,
        base_weights: BaseWeights | None = None,
    ) -> None:
        self.targets = targets
        self.shards = shards
        self.base_weights = base_weights
        self.max_rank = max_rank
        self.dtype = dtype
        self.allowed_roots = None if allowed_roots is None else tuple(allowed_roots)
        self.allow_pickle = allow_pickle
        self.max_file_bytes = max_file_bytes
        self.max_tensors = max_tensors
        self._adapters: dict[str, HostAdapter] = {}

    def load(
        self, name: str, path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
    ) -> HostAdapter:
        """Load the adapter at ``path`` as ``name`` (:meth:`read`, then :meth:`add`); on failure nothing
        changes.

        Raises:
            DuplicateAdapterError: ``name`` is already held.
            AdapterLoadError: and its subclasses, as :func:`load_adapter`.
        """
        self._refuse_held(name)
        return self.add(self.read(name, path, root=root))

    def read(
        self, name: str, path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
    ) -> HostAdapter:
        """Read the adapter at ``path`` as ``name`` (see :func:`load_adapter`) without adding it.

        ``root``, if given, confines this adapter (its folder and every file read from it) to that one
        folder instead of the tier's ``allowed_roots``.

        Raises:
            AdapterLoadError: and its subclasses, as :func:`load_adapter`.
        """
        return load_adapter(
            name,
            path,
            self.targets,
            max_rank=self.max_rank,
            dtype=self.dtype,
            allowed_roots=self.allowed_roots if root is None else (root,),
            allow_pickle=self.allow_pickle,
            max_file_bytes=self.max_file_bytes,
            max_tensors=self.max_tensors,
            shards=self.shards,
            base_weights=self.base_weights,
        )

    def read_tensors(self, tensors: AdapterTensors) -> HostAdapter:
        """Read an adapter handed over in memory (:func:`~lora_pin.weights.tensors.adapter_tensors`) as
        :meth:`read` reads one from disk: the same checks and errors; with ``shards``, this rank's part.

        Raises:
            AdapterLoadError: as :func:`load_adapter`.
        """
        with tensors.open() as file:
            return load_opened(
                file,
                self.targets,
                max_rank=self.max_rank,
                dtype=self.dtype,
                shards=self.shards,
                base_weights=self.base_weights,
            )

    def add(self, adapter: HostAdapter) -> HostAdapter:
        """Hold ``adapter`` (from :meth:`read`) under its name.

        Raises:
            DuplicateAdapterError: an adapter of that name is already held.
        """
        self._refuse_held(adapter.name)
        self._adapters[adapter.name] = adapter
        return adapter

    def _refuse_held(self, name: str) -> None:
        if name in self._adapters:
            raise DuplicateAdapterError(
                f"adapter {name!r} is already in the host tier ({self._adapters[name].path})"
            )

    def drop(self, name: str) -> HostAdapter:
        """Remove and return adapter ``name``.

        Raises:
            AdapterNotFoundError: ``name`` is not held; the message lists what is.
        """
        try:
            return self._adapters.pop(name)
        except KeyError:
            raise AdapterNotFoundError(
                f"adapter {name!r} is not in the host tier (held: {_listing(self._adapters) or 'none'})"
            ) from None

    def __getitem__(self, name: str) -> HostAdapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise AdapterNotFoundError(
                f"adapter {name!r} is not in the host tier (held: {_listing(self._adapters) or 'none'})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)

    @property
    def nbytes(self) -> int:
        """Host bytes held by every adapter in the tier."""
        return sum(a.nbytes for a in self._adapters.values())
