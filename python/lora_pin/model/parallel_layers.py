"""The sharded LoRA forward: a wrapper around a framework's tensor-parallel linear that adds this
rank's delta.

Per layer kind (the rules are in :mod:`lora_pin.parallel.sharding`), with ``T`` the step's tokens, ``R`` the
pool's rank and ``tp`` the group's size:

- column: shrink with the full A, expand with this rank's rows of B into the local output. No collective.
  Fully sharded: shrink with this rank's chunk of A's rows (``[T, n * R/tp]``), all-gather to ``[T, n * R]``,
  then expand as before.
- row: the base layer's partial product first (before its all-reduce), shrink on the input shard (a partial
  ``[T, R]``), expand with the full B into the partial product, then the base layer's own all-reduce, which
  sums the deltas with the products. Fully sharded: the ``[T, R]`` is all-reduced first, and each rank expands
  its own output columns into the partial product (the base all-reduce assembles them).

A DoRA row is then rescaled by its factor (this rank's output features' factors): a column layer's
output around its local bias, as on one process; a row layer's partial product as it is, before the
all-reduce, which sums ``f * partial`` over the ranks into ``f * (W x + s B A x)`` and adds the bias after.

Rows with no adapter are never touched, so after the base layer's all-reduce they equal the sharded base
model's output bit for bit.

How the work runs is the backend's (:mod:`lora_pin.ops.backends`): a plain shard's delta as a plain
layer's, a fully sharded layer's as a shrink and an expand run apart around the collective
(:meth:`~lora_pin.ops.backends.LoRABackend.split_delta`). A group that the backend knows no row of the
step uses (the CPU's reads the arrays; a device's never does) is skipped, collective included; that is
read from the group's full ranks, the same on every process, so every process of the group makes the
same collective calls (a column layer's chunk may hold none of a slot's rank while another process's
holds some of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lora_pin.model.layers import LoRALinear
from lora_pin.model.segments import StepSegments
from lora_pin.ops.backends import LoRABackend
from lora_pin.parallel import CollectiveLog, GroupShard, RowCall, ShardPlan, parallel_kind
from lora_pin.weights.pool import GroupBuffers

__all__ = ["ParallelLoRALinear", "wrap_parallel"]


class ParallelLoRALinear(LoRALinear):
    """A framework's parallel linear plus this rank's share of each row's adapter delta.

    Args:
        base_layer: the framework's layer, kept as is.
        buffers: this rank's device-pool buffers of the layer's group (shapes in
            :meth:`~lora_pin.parallel.sharding.GroupShard.pool_shape`).
        active_step: returns the active :class:`~lora_pin.model.segments.StepSegments`, or None.
        shard: the layer's sharding on this rank.
        row_call: for a row-parallel layer, how to run it in two halves (required then).
        returns_bias: the layer's forward returns ``(out, bias)``.
        log: where the collectives this layer runs are counted.
        backend: as for :class:`~lora_pin.model.layers.LoRALinear`.

    Every rank must run the same steps through the same layers: the fully sharded collectives are matched
    across ranks by order.
    """

    def __init__(
        self,
        base_layer: torch.nn.Module,
        buffers: GroupBuffers,
        active_step: Callable[[], StepSegments | None],
        *,
        shard: GroupShard,
        row_call: RowCall | None,
        returns_bias: bool = False,
        log: CollectiveLog | None = None,
        backend: LoRABackend | None = None,
    ) -> None:
        super().__init__(base_layer, buffers, active_step, returns_bias=returns_bias, backend=backend)
        self._shard = shard
        self._row_call = row_call
        self._log = log if log is not None else CollectiveLog()
        group = buffers.group
        self._offsets = shard.b_offsets(group)
        self._columns = shard.out_columns(group)
        self._column = shard.layout.kind == "column"
        # A fully sharded column layer's shrink runs over its chunk of each slot's rank.
        self._shrink_ranks = self._local_ranks if self._column and shard.fully_sharded else None

    def forward(self, x: torch.Tensor) -> Any:
        """``[..., in_local] -> [..., out_local]``: the layer's output with this rank's delta (for a row
        layer, added before the layer's all-reduce); the same type the layer returns."""
        if self._column:
            result = self.base_layer(x)
            self._add_delta(result[0] if self._returns_bias else result, x)
            return result
        assert self._row_call is not None
        partial = self._row_call.partial(self.base_layer, x)
        self._add_delta(partial, x)
        return self._row_call.reduce(self.base_layer, partial)

    def _add_delta(self, out: torch.Tensor, x: torch.Tensor) -> None:
        step = self._active_step()
        if step is None or not step.any_adapter:
            return
        self._check_dtypes(x, out)
        buf = self._pool_buffers
        if not self._shard.fully_sharded:
            self._backend.add_lora_linear(step, buf, out, x, self._offsets, self._dora_bias)
            return
        # The shrink and expand run apart, around the collective that joins the processes' parts.
        split = self._backend.split_delta(step, buf, x, self._offsets, self._shrink_ranks)
        if split is None:
            return
        v = split.shrink(x.reshape(-1, x.shape[-1]))
        flat_out = out.view(-1, out.shape[-1])
        if self._column:
            split.expand(flat_out, self._all_gather(v, self._n_slices))
        else:
            self._all_reduce(v)  # a partial [T, R]
            lo, hi = self._columns
            split.expand(flat_out[:, lo:hi], v)

    def _all_gather(self, v_local: torch.Tensor, n: int) -> torch.Tensor:
        """A column layer's ``[T, n * chunk]`` shrinks of every process, as the ``[T, n * chunk * tp]``
        its expand reads."""
        tp = self._shard.tp
        tokens, chunk = v_local.shape[0], v_local.shape[1] // n
        gathered = v_local.new_empty(tp.size * tokens, v_local.shape[1])
        self._log.add("all_gather", v_local)
        dist.all_gather_into_tensor(gathered, v_local, group=tp.group)
        # [tp, T, n, chunk] -> [T, n, tp, chunk]: slice s's full rank row j * chunk + k is rank j's k.
        return gathered.view(tp.size, tokens, n, chunk).permute(1, 2, 0, 3).reshape(tokens, -1)

    def _all_reduce(self, v: torch.Tensor) -> None:
        tp = self._shard.tp
        self._log.add("all_reduce", v)
        dist.all_reduce(v, group=tp.group)

    def _dora_bias(self) -> torch.Tensor | None:
        """A row layer's partial product holds no bias (its reduce adds it); a column layer's output
        holds its local bias (a ``DTensor`` bias: its local shard), unless the layer returns it apart."""
        if self._shard.layout.kind == "row" or self._returns_bias:
            return None
        bias = getattr(self.base_layer, "bias", None)
        # A DTensor's local shard first: detaching the DTensor itself fails under inference mode.
        to_local = getattr(bias, "to_local", None)
        if to_local is not None:
            bias = to_local()
        return None if bias is None else bias.detach()

    def _local_ranks(self) -> torch.Tensor:
        """int32 ``[slots, n_slices]``: each slot's rows of a fully sharded column layer's chunk of the
        rank dimension on this rank (0 where the chunk starts past the slot's rank)."""
        buf = self._pool_buffers
        chunk = buf.a.shape[1] // self._n_slices
        first = self._shard.tp.rank * chunk
        return (buf.ranks - first).clamp(0, chunk).to(torch.int32)

    def extra_repr(self) -> str:
        tp = self._shard.tp
        mode = ", fully_sharded" if self._shard.fully_sharded else ""
        return f"{super().extra_repr()}, {self._shard.layout.kind}, tp={tp.rank}/{tp.size}{mode}"


def wrap_parallel(
    original: torch.nn.Module,
    buffers: GroupBuffers,
    active_step: Callable[[], StepSegments | None],
    plan: ShardPlan[GroupShard],
    log: CollectiveLog | None = None,
    backend: LoRABackend | None = None,
) -> ParallelLoRALinear | None:
    """The wrapper of a cut layer (None when ``buffers``' group is not cut on ``plan``)."""
    shard = plan.group(buffers.group.key)
    kind = parallel_kind(original)
    if shard is None or kind is None:
        return None
    return ParallelLoRALinear(
        original,
        buffers,
        active_step,
        shard=shard,
        row_call=kind.row_call,
        returns_bias=kind.returns_bias,
        log=log,
        backend=backend,
    )
