"""Which part of each adapter tensor this process reads, holds and serves: a :class:`ShardPlan`.

One process holds the whole of every tensor: its plan is :data:`WHOLE`, a plan that cuts nothing, as
:class:`~lora_pin.parallel.SingleProcess` is the collective that agrees with nobody. A tensor-parallel
rank's plan (made by :func:`lora_pin.parallel.shard_plan` from the model's parallel layers, under the rules
of :mod:`lora_pin.parallel.sharding`) cuts the groups of its parallel layers; the others it holds whole.
The weights code (the checks, the host modules, the pool's buffers) asks the plan for every width, shape
and range, and never asks which of the two it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from lora_pin.errors import SpecError
from lora_pin.weights.targets import LinearTarget, TargetGroup

__all__ = ["WHOLE", "GroupCut", "MemberShard", "ShardPlan"]


@dataclass(frozen=True)
class MemberShard:
    """What one target module's adapter tensors look like unsharded, and which part of them this process
    holds.

    ``a_cols`` and ``b_rows`` are ``(begin, end)`` ranges of the stored ``A [r, full_in]`` columns and
    ``B [full_out, r]`` rows; :meth:`a_rows` gives the range of A's rows (the rank dimension), cut only for
    a fully sharded column layer (``cut_rank``, whose chunk of rows depends on ``tp_rank``)."""

    full_in: int
    full_out: int
    a_cols: tuple[int, int]
    b_rows: tuple[int, int]
    cut_rank: bool = False
    tp_rank: int = 0

    @classmethod
    def whole(cls, target: LinearTarget) -> MemberShard:
        """All of ``target``'s tensors: A ``[r, in]`` and B ``[out, r]`` as stored."""
        return cls(target.in_features, target.out_features, (0, target.in_features), (0, target.out_features))

    @property
    def is_whole(self) -> bool:
        """Whether this process holds the stored tensors whole (it reads them without slicing)."""
        return not self.cut_rank and self.a_cols == (0, self.full_in) and self.b_rows == (0, self.full_out)

    def a_rows(self, rank: int, chunk: int) -> tuple[int, int]:
        """The rows of an ``A [rank, full_in]`` this process holds: all of them, or its fully sharded chunk
        of ``chunk`` rows (maybe empty: padding rows past ``rank`` are zero, never stored)."""
        if not self.cut_rank:
            return 0, rank
        begin = min(self.tp_rank * chunk, rank)
        return begin, min(begin + chunk, rank)


class GroupCut(Protocol):
    """One target group as a plan cuts it: what the weights code needs of a cut
    (:class:`lora_pin.parallel.GroupShard` is one)."""

    @property
    def members(self) -> tuple[MemberShard, ...]:
        """Per member of the group, in slice order, its :class:`MemberShard`."""
        ...

    @property
    def inputs_cut(self) -> bool:
        """Whether the layer's input columns are cut (row-parallel): a row's norm is then a partial sum."""
        ...

    def pool_shape(self, group: TargetGroup, max_rank: int) -> tuple[int, int, int]:
        """``(a_rank, b_out, b_rank)`` of the device pool's buffers for the group."""
        ...

    def host_shape(self, group: TargetGroup, rank: int, max_rank: int) -> tuple[int, int, int]:
        """``(a_rank, b_out, b_rank)`` of one adapter's host module at slice rank ``rank``."""
        ...

    def b_offsets(self, group: TargetGroup) -> tuple[int, ...]:
        """The slices' row offsets in this process's B."""
        ...


G_co = TypeVar("G_co", bound=GroupCut, covariant=True)


class ShardPlan(Generic[G_co]):
    """Every target group's cut on this process, by group key; a group it does not name is held whole.

    Args:
        groups: the cut groups, by group key: the group and its cut (none: :data:`WHOLE`'s).
        parallel: this process is one rank of a tensor-parallel group (False: the only process). Every
            rank then reads the same adapters, so what one process alone may serve (MoE expert weights,
            a load plan recorded by an earlier read) is not offered.
        ranks: the processes the groups are cut over.
        fully_sharded: the adapters' rank dimension is cut too (S-LoRA's scheme).
        max_rank: the pool's rank, which sets a fully sharded column layer's chunk of rows
            (``ceil(max_rank / ranks)``); needed only when ``fully_sharded``.

    Raises:
        SpecError: ``fully_sharded`` without ``max_rank``.
    """

    def __init__(
        self,
        groups: Mapping[str, tuple[TargetGroup, G_co]] | None = None,
        *,
        parallel: bool = False,
        ranks: int = 1,
        fully_sharded: bool = False,
        max_rank: int | None = None,
    ) -> None:
        if fully_sharded and max_rank is None:
            raise SpecError("shard plan: a fully sharded plan needs the pool's rank (max_rank)")
        self.parallel = parallel
        self.ranks = ranks
        self.fully_sharded = fully_sharded
        self.max_rank = max_rank
        self._groups = dict(groups or {})
        self._members: dict[str, MemberShard] = {}
        for group, cut in self._groups.values():
            for member, shard in zip(group.members, cut.members, strict=True):
                self._members[member.key] = shard
        self._rank_cut = {
            key for key, (_, cut) in self._groups.items() if any(m.cut_rank for m in cut.members)
        }
        # The whole shard of each uncut target asked for, by key, with the target it was made for: asked
        # for every module of every load, made once (another model's target of the same key replaces it).
        self._whole: dict[str, tuple[LinearTarget, MemberShard]] = {}

    @property
    def rank_chunk(self) -> int:
        """Rows of the rank dimension this process holds of a fully sharded column layer.

        Raises:
            SpecError: the plan has no pool rank (it is not fully sharded, and no member cuts the rank).
        """
        return -(-self._pool_rank() // self.ranks)

    def group(self, key: str) -> G_co | None:
        """The cut of target group ``key``, or None for a group held whole (not cut on this process)."""
        found = self._groups.get(key)
        return None if found is None else found[1]

    def member(self, target: LinearTarget) -> MemberShard:
        """What this process holds of ``target``'s tensors (:meth:`MemberShard.whole` when not cut)."""
        shard = self._members.get(target.key)
        if shard is not None:
            return shard
        held = self._whole.get(target.key)
        if held is None or held[0] is not target:
            held = self._whole[target.key] = (target, MemberShard.whole(target))
        return held[1]

    def cuts_rank(self, group: TargetGroup) -> bool:
        """Whether this process holds only a chunk of the rank dimension of some member of ``group``."""
        return group.key in self._rank_cut

    def inputs_cut(self, key: str) -> bool:
        """Whether target group ``key``'s input columns are cut (row-parallel), so a DoRA norm over its
        rows is a partial sum that the other ranks' parts complete."""
        cut = self.group(key)
        return cut is not None and cut.inputs_cut

    def pool_shape(self, group: TargetGroup, max_rank: int) -> tuple[int, int, int]:
        """``(a_rank, b_out, b_rank)`` of ``group``'s pool buffers: A ``[slots, n_slices * a_rank, in]``
        and B ``[slots, b_out, b_rank]`` (whole: ``max_rank, out_total, max_rank``)."""
        cut = self.group(group.key)
        return (max_rank, group.out_total, max_rank) if cut is None else cut.pool_shape(group, max_rank)

    def host_shape(self, group: TargetGroup, rank: int) -> tuple[int, int, int]:
        """``(a_rank, b_out, b_rank)`` of an adapter's host module for ``group`` whose largest slice rank is
        ``rank``: A ``[n_slices * a_rank, in]`` and B ``[b_out, b_rank]`` (whole: ``rank, out_total,
        rank``)."""
        cut = self.group(group.key)
        if cut is None:
            return rank, group.out_total, rank
        # Only a fully sharded column layer's chunk depends on the pool's rank.
        return cut.host_shape(group, rank, self._pool_rank() if self.cuts_rank(group) else rank)

    def b_offsets(self, group: TargetGroup) -> tuple[int, ...]:
        """Row offsets of the slices in this process's B of ``group``."""
        cut = self.group(group.key)
        return group.slice_offsets if cut is None else cut.b_offsets(group)

    def _pool_rank(self) -> int:
        if self.max_rank is None:
            raise SpecError("shard plan: the pool's rank is not known")
        return self.max_rank

    def whole_widths(self, group: TargetGroup) -> tuple[int, int]:
        """``(in, out_total)`` of ``group`` unsharded: the same on every tensor-parallel rank."""
        cut = self.group(group.key)
        if cut is None:
            return group.in_features, group.out_total
        return cut.members[0].full_in, sum(m.full_out for m in cut.members)

    def __repr__(self) -> str:
        if not self.parallel:
            return "ShardPlan(whole)"
        mode = ", fully_sharded" if self.fully_sharded else ""
        return f"ShardPlan({len(self._groups)} cut groups over {self.ranks} ranks{mode})"


#: The plan of one process: every tensor whole.
WHOLE: ShardPlan[Any] = ShardPlan()
