"""The host tier's data: one adapter's weights normalised into CPU tensors per target group.

For each target group an adapter touches (by the group's key, ``model.layers.0.self_attn.qkv_proj``),
:class:`HostModule` holds A ``[n_slices * rank, in]`` and B ``[out_total, rank]`` in the serving dtype, laid
out like a device pool slot with ``rank`` (the largest rank among the group's slices in this adapter) in
place of the pool's max rank: slice s has A rows
``[s * rank, s * rank + r_s)`` and B rows ``[off_s, off_{s+1})``, columns ``[0, r_s)``; everything else is
zero, so a slice the adapter lacks contributes nothing. The tensors are page-locked when CUDA is available,
so copies into the device pool can be asynchronous. :class:`HostAdapter` holds an adapter's modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_pin.weights.config import AdapterConfig
from lora_pin.weights.shards import GroupCut, ShardPlan
from lora_pin.weights.targets import LoRATargets, TargetGroup


@dataclass(frozen=True)
class HostModule:
    """One adapter's weights for one target group.

    ``a``: ``[n_slices * rank, in]``; ``b``: ``[out_total, rank]``; ``ranks`` / ``scalings``: per slice
    (0 and 0.0 for a slice the adapter does not target), also as the int32 / float32 ``[n_slices]``
    tensors ``rank_tensor`` / ``scaling_tensor`` the pool copies.

    A DoRA adapter's module also holds ``magnitude``, float32 ``[out_total]`` (its
    ``lora_magnitude_vector`` on the rows of the slices it targets, 0 elsewhere), and, once computed
    against the model's base weight, ``factor``, float32 ``[out_total]`` (:func:`~lora_pin.weights.dora.
    checked_factor`: ``m / ||W + s B A||`` per output feature, 1 on the slices it does not target), which
    the pool copies beside A and B. Both None for plain LoRA. On a tensor-parallel rank a column
    layer's magnitudes and factors are its output rows'; a row-parallel layer's factor waits, None, for
    the other ranks' parts of its norms, this rank's part held in ``norm_parts`` (float64
    ``[2, out_total]``, :func:`~lora_pin.weights.dora.dora_norm_parts`) until
    :func:`~lora_pin.weights.dora.finish_factors` completes them.
    """

    group: TargetGroup
    a: torch.Tensor
    b: torch.Tensor
    ranks: tuple[int, ...]
    scalings: tuple[float, ...]
    rank_tensor: torch.Tensor
    scaling_tensor: torch.Tensor
    magnitude: torch.Tensor | None = None
    factor: torch.Tensor | None = None
    norm_parts: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """The A rows reserved per slice (the largest slice rank)."""
        return self.a.shape[0] // self.group.n_slices


def _dora_nbytes(module: HostModule) -> int:
    return sum(t.nbytes for t in (module.magnitude, module.factor) if t is not None)


def _whole_dora_nbytes(module: HostModule, shards: ShardPlan[GroupCut]) -> int:
    """:func:`_dora_nbytes` of ``module`` on an unsharded model: the same on every tensor-parallel rank
    (a row-parallel factor still pending counts as the factor it becomes)."""
    if module.magnitude is None:
        return 0
    _, full_out = shards.whole_widths(module.group)
    held = 1 + (module.factor is not None or module.norm_parts is not None)
    return held * full_out * module.magnitude.element_size()


@dataclass(frozen=True)
class HostAdapter:
    """One adapter in the host tier: its :class:`HostModule` per target group key it touches.

    Groups it does not touch are absent (the pool zeroes them). ``targets`` is the model description it was
    validated against; ``tensors_applied`` counts the file's tensors that were used (all of them).
    ``digest`` is the adapter's content digest (:mod:`lora_pin.weights.digest`: 64 hex characters, the
    same for the same weights whatever the folder, format, process or tensor-parallel rank), and
    ``whole_nbytes`` the host bytes of the whole adapter unsharded (:attr:`nbytes` on a single process;
    on a tensor-parallel rank, which holds only its shard, the same figure on every rank).
    """

    name: str
    path: Path
    config: AdapterConfig
    targets: LoRATargets
    dtype: torch.dtype
    modules: Mapping[str, HostModule]
    tensors_applied: int
    digest: str
    whole_nbytes: int

    @property
    def max_rank(self) -> int:
        """The largest rank of any module (what the pool's max rank must hold)."""
        return max(max(m.ranks) for m in self.modules.values())

    @property
    def ranks(self) -> tuple[int, ...]:
        """The distinct ranks of the adapter's modules, ascending."""
        return tuple(sorted({r for m in self.modules.values() for r in m.ranks if r}))

    @property
    def dora(self) -> bool:
        """Whether this is a DoRA adapter (its modules carry magnitudes and factors)."""
        return self.config.use_dora

    @property
    def nbytes(self) -> int:
        """Host bytes held (A and B of every module, zero padding of fused slices included, and a DoRA
        adapter's magnitudes and factors)."""
        return sum(m.a.nbytes + m.b.nbytes + _dora_nbytes(m) for m in self.modules.values())

    @property
    def device_bytes(self) -> int:
        """Bytes of the adapter's own weights at their own ranks, in the serving dtype (no padding), and
        of a DoRA adapter's factors (one per output feature of each group it touches).

        A :class:`~lora_pin.weights.pool.DevicePool` slot holds ``pool.slot_nbytes`` whatever the adapter.
        """
        size = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for module in self.modules.values():
            group = module.group
            widths = group.slice_widths
            for s, rank in enumerate(module.ranks):
                member = group.members[0 if group.experts else s]
                total += rank * (member.in_features + widths[s]) * size
            if module.magnitude is not None:
                # A DoRA factor per output feature, in the serving dtype.
                total += module.b.shape[0] * size
        return total

    @property
    def pinned(self) -> bool:
        """Whether every host tensor is page-locked."""
        return all(m.a.is_pinned() and m.b.is_pinned() for m in self.modules.values())


class _Slab:
    """One allocation per adapter, handed out as views: one (pinned) allocation instead of one per tensor,
    which avoids an mmap/munmap and fresh page faults for every large tensor."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.memory = torch.empty(numel, dtype=dtype, pin_memory=pin)
        self.used = 0

    def take(self, shape: tuple[int, int], zero: bool) -> torch.Tensor:
        numel = shape[0] * shape[1]
        view = self.memory[self.used : self.used + numel].view(shape)
        self.used += numel
        return view.zero_() if zero else view
