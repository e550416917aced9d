"""Read recipes: what a load of an adapter decides from its config, its weight file's header and the model
before it reads a tensor (see :class:`_ReadRecipe`), then kept per model so that a later load of an adapter
trained alike (the same config and header) only reads and hashes its tensors.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from lora_pin.weights.building import _non_finite
from lora_pin.weights.digest import ServedModule, adapter_digest
from lora_pin.weights.host_adapter import HostAdapter, HostModule
from lora_pin.weights.reader import AdapterFile, LoraTensorPair
from lora_pin.weights.targets import LoRATargets, TargetGroup

# The stored dtypes whose NaN/Inf the core counts as it reads (lora_pin.weights.reader.AdapterFile.read_many).
_SEARCHED = frozenset(("F64", "F32", "F16", "BF16"))
# One read of a recipe: tensor name, stored dtype, shape, file offset, byte offset in the slab, bytes.
_RecipeRead = tuple[str, str, tuple[int, ...], int, int, int]
# One group of a recipe: the group, A's and B's element offset in the slab and shape, per slice rank and
# scaling, and the rank and scaling tensors (shared by every load: see _group_tensors).
_RecipeModule = tuple[
    TargetGroup,
    int,
    tuple[int, int],
    int,
    tuple[int, int],
    tuple[int, ...],
    tuple[float, ...],
    torch.Tensor,
    torch.Tensor,
]


@dataclass(frozen=True)
class _ReadRecipe:
    """What a load of one adapter decides from its config, its weight file's header and the model
    (every check passed, the slab's layout, what each tensor's bytes go where, the ranks and scalings,
    the modules its digest covers; :meth:`decide`), before any tensor is read: the load itself is then
    one read of every tensor into its place (:meth:`load`). Kept so that a later load with the same
    config and header bytes
    (:attr:`~lora_pin.weights.reader.AdapterFile.layout_key`), for the same model, max rank, dtype and
    memory pinning, only reads and hashes the tensors: adapters trained alike share all of it, and
    deciding it again costs more than reading them.

    Only plain loads have a recipe: a safetensors file with no unused tensor (PEFT's copies of base weights
    are compared by value on every load), no DoRA magnitudes, no expert weights, unsharded, every tensor
    read straight into its place in the serving dtype and those places covering the whole slab (no
    padding to zero, and the core's NaN/Inf search covers every element).
    """

    numel: int
    pin: bool
    reads: tuple[_RecipeRead, ...]
    modules: tuple[_RecipeModule, ...]
    served: tuple[ServedModule, ...]
    tensors: int
    whole_nbytes: int

    @classmethod
    def decide(
        cls,
        file: AdapterFile,
        targets: LoRATargets,
        ranks: dict[str, int],
        pairs: dict[str, LoraTensorPair],
        dtype: torch.dtype,
        pin: bool,
    ) -> _ReadRecipe | None:
        """The recipe of loading ``file``, decided from its header and its checked ``ranks`` and ``pairs``
        (:func:`~lora_pin.weights.model_checks._check_against_model`) before any tensor is read; None when
        the load is not a plain one (see the class): the host modules are then built one by one
        (:mod:`lora_pin.weights.building`). A recipe lays the slab out as that building does: per touched
        group in the targets' order, A ``[n_slices * rank, in]`` then B ``[out_total, rank]``, with slice
        s's tensors at A's rows ``[s * rank, (s + 1) * rank)`` and B's rows ``[off_s, off_{s+1})``."""
        if file.layout_key is None or file.unused or file.config.use_dora or file.dtype != dtype:
            return None
        size = dtype.itemsize
        config = file.config
        at = 0
        reads: list[_RecipeRead] = []
        built: list[tuple[TargetGroup, int, tuple[int, int], int, tuple[int, int], tuple[int, ...]]] = []
        scalings: list[tuple[float, ...]] = []
        served: list[ServedModule] = []
        for group in targets.groups:
            members = group.members
            if not any(m.key in ranks for m in members):
                continue  # not touched
            rank = ranks.get(members[0].key, 0)
            if group.experts or any(ranks.get(m.key, 0) != rank for m in members):
                return None  # an expert weight, or slices of several ranks (padding to zero)
            width = group.in_features
            a_at, b_at = at, at + group.n_slices * rank * width
            at = b_at + group.out_total * rank
            group_scalings = tuple(config.scaling_for(m.key, rank) for m in members)
            for s, member in enumerate(members):
                pair = pairs[member.key]
                for name, element in (
                    (pair.a_name, a_at + s * rank * width),
                    (pair.b_name, b_at + group.slice_offsets[s] * rank),
                ):
                    stored_dtype, shape, begin, end = file.stored(name)
                    if stored_dtype not in _SEARCHED:
                        return None  # the core's NaN/Inf search would not cover it
                    reads.append((name, stored_dtype, shape, begin, element * size, end - begin))
                served.append(ServedModule(member.key, rank, group_scalings[s], pair.a_name, pair.b_name))
            built.append(
                (
                    group,
                    a_at,
                    (group.n_slices * rank, width),
                    b_at,
                    (group.out_total, rank),
                    (rank,) * len(members),
                )
            )
            scalings.append(group_scalings)
        modules = tuple(
            (*module, group_scalings, *_group_tensors(module[5], group_scalings, pin))
            for module, group_scalings in zip(built, scalings, strict=True)
        )
        return cls(at, pin, tuple(reads), modules, tuple(served), len(reads), at * size)

    def load(self, file: AdapterFile, targets: LoRATargets, dtype: torch.dtype) -> HostAdapter:
        """:func:`~lora_pin.weights.host_tier.load_opened` of ``file`` by this recipe: one read of every
        tensor, then the views.

        Raises:
            AdapterLoadError: a tensor could not be read, holds a NaN/Inf, or the file changed.
        """
        memory = torch.empty(self.numel, dtype=dtype, pin_memory=self.pin)
        non_finite = file.read_at(self.reads, memory.data_ptr())
        size = memory.element_size()
        for (tensor_name, _, shape, _, at, nbytes), bad in zip(self.reads, non_finite, strict=True):
            if bad:
                copied = memory[at // size : (at + nbytes) // size].view(shape)
                raise _non_finite(file, tensor_name, copied, bad)
        file.check_unchanged()
        modules = {}
        for group, a_at, a_shape, b_at, b_shape, ranks, scalings, rank_tensor, scaling_tensor in self.modules:
            a = memory.as_strided(a_shape, (a_shape[1], 1), a_at)
            b = memory.as_strided(b_shape, (b_shape[1], 1), b_at)
            modules[group.key] = HostModule(group, a, b, ranks, scalings, rank_tensor, scaling_tensor)
        digest = adapter_digest(file.digests.result(), self.served)
        return HostAdapter(
            file.name,
            file.directory,
            file.config,
            targets,
            dtype,
            modules,
            self.tensors,
            digest,
            self.whole_nbytes,
        )


@functools.lru_cache(maxsize=4096)
def _group_tensors(
    ranks: tuple[int, ...], scalings: tuple[float, ...], pin: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int32 rank and float32 scaling tensors ``[n_slices]`` of a host module with these slice ranks
    and scalings. Nothing writes them (the pool copies them into its slots), so every module with the same
    figures shares one pair, whatever its adapter or recipe: the groups of one adapter mostly share a
    few, and so do the recipes of one rank and alpha."""
    rank_tensor = torch.tensor(ranks, dtype=torch.int32)
    scaling_tensor = torch.tensor(scalings, dtype=torch.float32)
    if pin:
        return rank_tensor.pin_memory(), scaling_tensor.pin_memory()
    return rank_tensor, scaling_tensor


class _RecipeCache:
    """The last few :class:`_ReadRecipe` of one model's targets, by layout key and load settings."""

    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._held: dict[tuple[object, ...], _ReadRecipe] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[object, ...]) -> _ReadRecipe | None:
        with self._lock:
            found = self._held.pop(key, None)
            if found is not None:
                self._held[key] = found
            return found

    def put(self, key: tuple[object, ...], recipe: _ReadRecipe | None) -> None:
        if recipe is None:
            return
        with self._lock:
            self._held[key] = recipe
            while len(self._held) > self._entries:
                del self._held[next(iter(self._held))]


def _recipes(targets: LoRATargets) -> _RecipeCache:
    """``targets``' recipe cache (held by the targets, so a recipe never outlives the model it checked)."""
    cache = targets.__dict__.get("_read_recipes")
    if cache is None:
        with _RECIPES_LOCK:
            cache = targets.__dict__.get("_read_recipes")
            if cache is None:
                cache = _RecipeCache(_RECIPES_PER_MODEL)
                object.__setattr__(targets, "_read_recipes", cache)
    return cache


_RECIPES_PER_MODEL = 32
_RECIPES_LOCK = threading.Lock()
