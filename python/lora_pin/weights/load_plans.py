"""Load plans: what the first load of an adapter decided, kept per model so that a later load of an adapter
trained alike (the same config and weight file header) only reads and hashes its tensors (see
:class:`_LoadPlan`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from lora_pin.weights.building import _non_finite, _served
from lora_pin.weights.digest import ServedModule, adapter_digest
from lora_pin.weights.hosted import HostAdapter, HostModule, _Slab
from lora_pin.weights.reader import AdapterFile, LoraTensorPair
from lora_pin.weights.targets import LoRATargets, TargetGroup

# One read of a plan: tensor name, stored dtype, shape, file offset, byte offset in the slab, bytes.
_PlannedRead = tuple[str, str, tuple[int, ...], int, int, int]
# One group of a plan: the group, A's and B's element offset in the slab and shape, per slice rank and
# scaling, and the rank and scaling tensors (the first load's: nothing writes them, the pool copies
# them, so every load by the plan shares them).
_PlannedModule = tuple[
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
class _LoadPlan:
    """What a load of one adapter decided from its config, its weight file's header and the model
    (every check passed, the slab's layout, what each tensor's bytes go where, the ranks and scalings,
    the modules its digest covers), kept so that a later load with the same config and header bytes
    (:attr:`~lora_pin.weights.reader.AdapterFile.layout_key`), for the same model, max rank, dtype and
    memory pinning, only reads and hashes the tensors: adapters trained alike share all of it, and
    deciding it again costs more than reading them.

    Only plain loads are kept: a safetensors file with no unused tensor (PEFT's copies of base weights
    are compared by value on every load), no DoRA magnitudes, no expert weights, unsharded, every tensor
    read straight into its place in the serving dtype and those places covering the whole slab (no
    padding to zero, and the core's NaN/Inf search covers every element).
    """

    numel: int
    pin: bool
    reads: tuple[_PlannedRead, ...]
    modules: tuple[_PlannedModule, ...]
    served: tuple[ServedModule, ...]
    tensors: int
    whole_nbytes: int

    @classmethod
    def of(
        cls,
        file: AdapterFile,
        pairs: dict[str, LoraTensorPair],
        slab: _Slab,
        modules: dict[str, HostModule],
        reads: list[tuple[str, torch.Tensor]],
        searched: list[tuple[tuple[str, torch.Tensor], int | None]],
        whole_nbytes: int,
    ) -> _LoadPlan | None:
        """The plan of a load that just succeeded (its slab, modules, reads and the core's NaN/Inf
        counts), or None when it is not a plain load (see the class)."""
        memory = slab.memory
        size, base = memory.element_size(), memory.data_ptr()
        if any(bad is None for _, bad in searched) or any(g.group.experts for g in modules.values()):
            return None
        planned = []
        for tensor_name, out in reads:
            dtype, shape, begin, end = file.stored(tensor_name)
            planned.append((tensor_name, dtype, shape, begin, out.data_ptr() - base, end - begin))
        if sum(r[5] for r in planned) != memory.nbytes:
            return None
        built = tuple(
            (
                m.group,
                (m.a.data_ptr() - base) // size,
                (m.a.shape[0], m.a.shape[1]),
                (m.b.data_ptr() - base) // size,
                (m.b.shape[0], m.b.shape[1]),
                m.ranks,
                m.scalings,
                m.rank_tensor,
                m.scaling_tensor,
            )
            for m in modules.values()
        )
        return cls(
            memory.numel(),
            memory.is_pinned(),
            tuple(planned),
            built,
            tuple(_served(modules.values(), pairs)),
            len(reads),
            whole_nbytes,
        )

    def load(self, file: AdapterFile, targets: LoRATargets, dtype: torch.dtype) -> HostAdapter:
        """:func:`~lora_pin.weights.host.load_opened` of ``file`` by this plan: one read of every tensor,
        then the views.

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


class _PlanCache:
    """The last few :class:`_LoadPlan` of one model's targets, by layout key and load settings."""

    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._held: dict[tuple[object, ...], _LoadPlan] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[object, ...]) -> _LoadPlan | None:
        with self._lock:
            found = self._held.pop(key, None)
            if found is not None:
                self._held[key] = found
            return found

    def put(self, key: tuple[object, ...], plan: _LoadPlan | None) -> None:
        if plan is None:
            return
        with self._lock:
            self._held[key] = plan
            while len(self._held) > self._entries:
                del self._held[next(iter(self._held))]


def _plans(targets: LoRATargets) -> _PlanCache:
    """``targets``' plan cache (held by the targets, so a plan never outlives the model it checked)."""
    cache = targets.__dict__.get("_load_plans")
    if cache is None:
        with _PLANS_LOCK:
            cache = targets.__dict__.get("_load_plans")
            if cache is None:
                cache = _PlanCache(_PLANS_PER_MODEL)
                object.__setattr__(targets, "_load_plans", cache)
    return cache


_PLANS_PER_MODEL = 32
_PLANS_LOCK = threading.Lock()
