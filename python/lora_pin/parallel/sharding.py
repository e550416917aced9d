"""The sharding rules: which part of an adapter's A and B each tensor-parallel rank holds and computes.

Two layer kinds, as Megatron-style tensor parallelism cuts a model:

- *column-parallel* (q, k, v, fused qkv, gate, up, fused gate_up): the layer's output rows are cut over the
  ranks; each rank holds the full A and the rows of B for its output shard, and its delta lands in its own
  output columns. A fused layer's output is several slices, each cut on its own (:class:`ColumnSlice`): under
  grouped-query attention with fewer kv heads than ranks, q is cut by ``tp_rank`` and k/v by
  ``tp_rank // kv_head_replicas`` (each kv head lives on ``kv_head_replicas`` ranks).
- *row-parallel* (o, down): the layer's input columns are cut; each rank holds A's columns for its input
  shard and the full B. Its delta is a partial sum, added to the base layer's partial output before the
  base layer's own all-reduce, which completes both.

With ``fully_sharded`` (S-LoRA's scheme) the rank dimension is cut as well: a column layer's A rows are cut
into ``tp_size`` chunks of the pool's rank (each rank's shrink gives ``[T, R / tp]``, all-gathered to
``[T, R]``); a row layer's B rows are cut by output (the ``[T, R]`` shrink is all-reduced, then each rank
expands its own output columns). A rank not divisible by ``tp_size`` is padded with zero rows, never refused:
a chunk is ``ceil(R / tp)`` rows, so a rank-8 adapter at TP = 16 has one row on each of eight ranks and none
on the other eight.

Every width here is checked once, when the layout is made; the weights code then only slices. A rank's
shards of every group make its :class:`~lora_pin.weights.shards.ShardPlan`
(:func:`lora_pin.parallel.shard_plan`): the plan type the weights code reads, of which one process's
(nothing cut) is the degenerate case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lora_pin.errors import SpecError
from lora_pin.weights.shards import MemberShard
from lora_pin.weights.targets import TargetGroup

__all__ = [
    "ColumnSlice",
    "GroupShard",
    "LayerKind",
    "ParallelLayout",
    "TensorParallel",
    "qkv_slices",
]

LayerKind = Literal["column", "row"]


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: this process's rank in the group, ``0 <= rank < size``.
        size: the group's size (TP).
        group: the ``torch.distributed`` process group the collectives run on (None: the default group).
        fully_sharded: also cut the adapters' rank dimension (see the module docstring); fewer bytes per rank,
            one more collective per layer.

    Raises:
        SpecError: ``size`` is not positive or ``rank`` is outside ``[0, size)``.
    """

    rank: int
    size: int
    group: Any = None
    fully_sharded: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise SpecError(f"TensorParallel: size must be a positive int, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise SpecError(f"TensorParallel: rank must be an int in [0, {self.size}), got {self.rank!r}")

    def rank_chunk(self, max_rank: int) -> int:
        """Rows of the rank dimension each rank holds in fully sharded mode: ``ceil(max_rank / size)``."""
        return -(-max_rank // self.size)


@dataclass(frozen=True)
class ColumnSlice:
    """One output slice of a column-parallel layer: ``full_out`` rows cut into ``count`` equal shards, of
    which this rank computes shard ``index`` (rows ``[index * full_out / count, (index + 1) * ...)``)."""

    full_out: int
    index: int
    count: int

    @property
    def width(self) -> int:
        """This rank's rows of the slice."""
        return self.full_out // self.count

    @property
    def rows(self) -> tuple[int, int]:
        """This rank's rows of the full slice, ``(begin, end)``."""
        return self.index * self.width, (self.index + 1) * self.width


def qkv_slices(
    tp: TensorParallel, *, q_out: int, kv_out: int, num_kv_heads: int
) -> tuple[ColumnSlice, ColumnSlice, ColumnSlice]:
    """The q, k and v slices of this rank for attention with ``num_kv_heads`` kv heads (GQA).

    q is cut by ``tp.rank`` into ``tp.size`` shards. k and v are cut the same way when there are at least as
    many kv heads as ranks; with fewer, each kv head is replicated on ``tp.size // num_kv_heads`` ranks and
    rank ``i`` holds head ``i // replicas``.

    Raises:
        SpecError: the heads do not divide over the ranks (``num_kv_heads`` and ``tp.size``, one a multiple
            of the other), or ``q_out`` does not divide by ``tp.size``.
    """
    if num_kv_heads < 1 or q_out % tp.size or kv_out % num_kv_heads:
        raise SpecError(
            f"qkv over TP={tp.size}: q_out={q_out} must divide by the ranks and kv_out={kv_out} by "
            f"num_kv_heads={num_kv_heads}"
        )
    q = ColumnSlice(q_out, tp.rank, tp.size)
    if num_kv_heads >= tp.size:
        if num_kv_heads % tp.size:
            raise SpecError(f"qkv over TP={tp.size}: {num_kv_heads} kv heads do not divide over the ranks")
        kv = ColumnSlice(kv_out, tp.rank, tp.size)
    else:
        if tp.size % num_kv_heads:
            raise SpecError(
                f"qkv over TP={tp.size}: {num_kv_heads} kv heads cannot be replicated evenly over the ranks"
            )
        kv = ColumnSlice(kv_out, tp.rank // (tp.size // num_kv_heads), num_kv_heads)
    return q, kv, kv


@dataclass(frozen=True)
class ParallelLayout:
    """How one of a framework's parallel linear layers is cut (what :func:`register_parallel_linear` asks).

    Attributes:
        kind: ``"column"`` or ``"row"``.
        tp: the group it is cut over.
        full_in: the unsharded layer's input width.
        slices: a column layer's output slices, in the order its local output stacks them (one for
            q_proj, three for a fused qkv_proj, two for gate_up_proj); a row layer's one slice is uncut
            (``ColumnSlice(full_out, 0, 1)``).

    Raises:
        SpecError: a width does not divide over its shards, or a row layer has more than one slice.
    """

    kind: LayerKind
    tp: TensorParallel
    full_in: int
    slices: tuple[ColumnSlice, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("column", "row"):
            raise SpecError(f"parallel layout: kind must be 'column' or 'row', got {self.kind!r}")
        if not self.slices:
            raise SpecError("parallel layout: a layer has at least one output slice")
        for s in self.slices:
            if s.count < 1 or not 0 <= s.index < s.count or s.full_out % s.count:
                raise SpecError(
                    f"parallel layout: output slice of {s.full_out} rows cannot be cut into {s.count} shards "
                    f"(shard {s.index})"
                )
        if self.kind == "row":
            if len(self.slices) != 1 or self.slices[0].count != 1:
                raise SpecError("parallel layout: a row-parallel layer has one uncut output slice")
            if self.full_in % self.tp.size:
                raise SpecError(
                    f"parallel layout: row-parallel input width {self.full_in} does not divide over "
                    f"TP={self.tp.size}"
                )

    @classmethod
    def column(cls, tp: TensorParallel, full_in: int, *slices: ColumnSlice | int) -> ParallelLayout:
        """A column-parallel layout; an int slice is ``full_out`` rows cut by ``tp.rank`` over ``tp.size``."""
        made = tuple(s if isinstance(s, ColumnSlice) else ColumnSlice(s, tp.rank, tp.size) for s in slices)
        return cls("column", tp, full_in, made)

    @classmethod
    def row(cls, tp: TensorParallel, full_in: int, full_out: int) -> ParallelLayout:
        """A row-parallel layout of an unsharded ``[full_out, full_in]`` layer."""
        return cls("row", tp, full_in, (ColumnSlice(full_out, 0, 1),))

    @property
    def local_in(self) -> int:
        """This rank's input width."""
        return self.full_in // self.tp.size if self.kind == "row" else self.full_in

    @property
    def local_out(self) -> int:
        """This rank's output width (the sum of its slices')."""
        return sum(s.width for s in self.slices)


@dataclass(frozen=True)
class GroupShard:
    """The sharding of one target group (one wrapped layer) on this rank.

    Attributes:
        layout: the layer's :class:`ParallelLayout`.
        members: per member of the group, in slice order, its :class:`MemberShard`.
        fully_sharded: whether the rank dimension is cut too.
    """

    layout: ParallelLayout
    members: tuple[MemberShard, ...]
    fully_sharded: bool

    @property
    def tp(self) -> TensorParallel:
        """The group the layer is cut over (its collectives run on ``tp.group``)."""
        return self.layout.tp

    @property
    def inputs_cut(self) -> bool:
        """Whether the layer is row-parallel (its input columns cut)."""
        return self.layout.kind == "row"

    def pool_shape(self, group: TargetGroup, max_rank: int) -> tuple[int, int, int]:
        """``(a_rank, b_out, b_rank)`` of the device pool's buffers for this group: A
        ``[slots, n_slices * a_rank, in]`` and B ``[slots, b_out, b_rank]``."""
        if self.fully_sharded and self.layout.kind == "column":
            chunk = self.tp.rank_chunk(max_rank)
            return chunk, group.out_total, chunk * self.tp.size
        if self.fully_sharded:
            return max_rank, group.out_total // self.tp.size, max_rank
        return max_rank, group.out_total, max_rank

    def host_shape(self, group: TargetGroup, rank: int, max_rank: int) -> tuple[int, int, int]:
        """``(a_rank, b_out, b_rank)`` of one adapter's host module whose largest slice rank is ``rank``
        (``max_rank``: the pool's, which fixes the fully sharded chunk)."""
        if self.fully_sharded and self.layout.kind == "column":
            return self.tp.rank_chunk(max_rank), group.out_total, rank
        if self.fully_sharded:
            return rank, group.out_total // self.tp.size, rank
        return rank, group.out_total, rank

    def b_offsets(self, group: TargetGroup) -> tuple[int, ...]:
        """The slices' row offsets in this rank's B (and columns of the output expand writes)."""
        if self.fully_sharded and self.layout.kind == "row":
            return 0, group.out_total // self.tp.size
        return group.slice_offsets

    def out_columns(self, group: TargetGroup) -> tuple[int, int]:
        """The columns of the layer's local output the delta is added to."""
        if self.fully_sharded and self.layout.kind == "row":
            width = group.out_total // self.tp.size
            return self.tp.rank * width, (self.tp.rank + 1) * width
        return 0, group.out_total


def group_shard(layout: ParallelLayout, group: TargetGroup, fully_sharded: bool) -> GroupShard:
    """The :class:`GroupShard` of ``group``, computed by a layer of ``layout``.

    Raises:
        SpecError: the group's members do not match the layout's slices (count or local widths), or a
            fully sharded row layer's output does not divide over the ranks.
    """
    tp = layout.tp
    widths = [m.out_features for m in group.members]
    if len(widths) != len(layout.slices) or any(
        w != s.width for w, s in zip(widths, layout.slices, strict=True)
    ):
        raise SpecError(
            f"{group.key!r}: its parallel layout has output slices {[s.width for s in layout.slices]} on "
            f"this rank but the LoRA targets are {widths} ({[m.module for m in group.members]})"
        )
    if group.in_features != layout.local_in:
        raise SpecError(
            f"{group.key!r}: its parallel layout takes {layout.local_in} inputs on this rank but the layer "
            f"reports {group.in_features}"
        )
    members = []
    for s in layout.slices:
        if layout.kind == "column":
            a_cols, b_rows = (0, layout.full_in), s.rows
        else:
            width = layout.full_in // tp.size
            a_cols = (tp.rank * width, (tp.rank + 1) * width)
            if fully_sharded:
                if s.full_out % tp.size:
                    raise SpecError(
                        f"{group.key!r}: fully sharded, the row-parallel output {s.full_out} must divide "
                        f"over TP={tp.size}"
                    )
                out = s.full_out // tp.size
                b_rows = (tp.rank * out, (tp.rank + 1) * out)
            else:
                b_rows = (0, s.full_out)
        cut_rank = fully_sharded and layout.kind == "column"
        members.append(MemberShard(layout.full_in, s.full_out, a_cols, b_rows, cut_rank, tp.rank))
    return GroupShard(layout, tuple(members), fully_sharded)
