"""The device slot pool: fixed per-group buffers that the shrink/expand ops read by slot index.

For each target group (by its key, ``model.layers.0.self_attn.qkv_proj``), allocated once:

* ``a``: ``[slots, max_rank * n_slices, in]``; slice s of slot k uses rows
  ``[s * max_rank, s * max_rank + r_s)``;
* ``b``: ``[slots, out_total, max_rank]``; slice s uses rows ``[off_s, off_{s+1})``, columns ``[0, r_s)``;
* ``ranks``: int32 ``[slots, n_slices]`` and ``scalings``: float32 ``[slots, n_slices]``;
* ``factors``: ``[slots, out_total]`` in the pool's dtype and ``dora``: int32 ``[slots]``: a DoRA adapter's
  factor per output feature (:mod:`lora_pin.weights.dora`) and 1 in ``dora`` where the slot's adapter has
  DoRA in this group; 1.0 and 0 otherwise. ``dora_slots`` mirrors ``dora`` on the host (a set of slots), so
  a step knows without reading the device whether a group has DoRA rows at all.

A tensor-parallel rank's pool (its :class:`~lora_pin.weights.shards.ShardPlan`) holds its shard of each
group: the widths are the layer's local ones, and a fully sharded group's A holds ``ceil(max_rank / tp)``
rows per slice (its chunk of the rank) or its B only the rank's output rows.

Everything of a slot outside its adapter's ranks is zero, and groups the adapter does not target are zero
with rank 0, so a reused slot never leaks the previous occupant's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_pin.errors import PoolError
from lora_pin.weights.host_adapter import HostAdapter, HostModule
from lora_pin.weights.shards import WHOLE, GroupCut, ShardPlan
from lora_pin.weights.targets import LoRATargets, TargetGroup

__all__ = ["DevicePool", "GroupBuffers", "SlotWrites"]


@dataclass(frozen=True)
class GroupBuffers:
    """The pool buffers of one target group; see the module docstring for the layout. ``factors``,
    ``dora`` and ``dora_slots`` are None for buffers made outside a pool (no DoRA adapter in them).

    ``page_rank`` is set for a paged pool's group (:class:`~lora_pin.weights.paged_pool.PagedDevicePool`):
    ``a`` and ``b`` are then ``a_pages [pages, n_slices * page_rank, in]`` and ``b_pages [pages, out_total,
    page_rank]``, the per-slot arrays have one entry per page (an adapter's slot is its first page), and
    ``max_rank`` is ``R``, each slice's width in the shrink's output."""

    group: TargetGroup
    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    factors: torch.Tensor | None = None
    dora: torch.Tensor | None = None
    dora_slots: set[int] | None = None
    page_rank: int | None = None
    max_rank: int | None = None

    @property
    def slice_offsets(self) -> list[int]:
        """Output row offsets of the slices, ``n_slices + 1`` entries, as the expand op takes them."""
        return list(self.group.slice_offsets)


class SlotWrites:
    """What the slot pool and the paged pool share: the per-group buffers by key, each slot's occupant
    and write count, the validation of an adapter before anything is written, and the copy (in place on
    CPU; on CUDA on a side stream the current stream waits for). A subclass allocates ``_buffers`` and
    writes a slot (``_write``)."""

    #: The pool's name in error messages.
    _what = "device pool"

    def _init_slots(
        self, targets: LoRATargets, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.targets = targets
        self.slots = slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self._buffers: dict[str, GroupBuffers] = {}
        self._occupant: list[str | None] = [None] * slots
        # Bumped by every write to a slot (fill or clear), so a caller can tell whether a slot's contents are
        # still the ones it saw: the manager checks it against the registry's slot epochs.
        self._writes: list[int] = [0] * slots
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Keeps each slot's host tensors alive until its asynchronous copy has run.
        self._in_flight: dict[int, tuple[torch.cuda.Event, HostAdapter]] = {}

    def occupant(self, slot: int) -> str | None:
        """The name of the adapter last filled into ``slot``, or None when it is empty.

        Raises:
            PoolError: ``slot`` is out of range.
        """
        self._check_slot(slot)
        return self._occupant[slot]

    def writes(self, slot: int) -> int:
        """How many times ``slot`` was written (filled or cleared) since the pool was allocated.

        A write that raised half-way counts too: the slot's contents are then unknown.

        Raises:
            PoolError: ``slot`` is out of range.
        """
        self._check_slot(slot)
        return self._writes[slot]

    def write_counts(self) -> tuple[int, ...]:
        """:meth:`writes` of every slot at once (what a step checks, without a call per slot)."""
        return tuple(self._writes)

    def buffers(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """``(a, b, ranks, scalings, slice_offsets)`` of the group with key ``key``
        (:attr:`~lora_pin.weights.targets.TargetGroup.key`: ``model.layers.0.self_attn.qkv_proj`` ...).

        Shapes (slot pool): a ``[slots, n_slices * max_rank, in]``, b ``[slots, out_total, max_rank]``,
        ranks int32 and scalings float32 ``[slots, n_slices]``, slice_offsets ``n_slices + 1`` ints (a
        paged pool's: see :class:`GroupBuffers`).

        Raises:
            PoolError: the targets have no such group.
        """
        try:
            buf = self._buffers[key]
        except KeyError:
            names = [g.key for g in self.targets.groups]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise PoolError(f"{self._what}: no group {key!r} (groups: {shown})") from None
        return buf.a, buf.b, buf.ranks, buf.scalings, buf.slice_offsets

    def group_buffers(self, key: str) -> GroupBuffers:
        """Every buffer of the group with key ``key`` (see the module docstring), DoRA's included.

        Raises:
            PoolError: the targets have no such group.
        """
        self.buffers(key)
        return self._buffers[key]

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise PoolError(f"{self._what}: slot {slot!r} out of range [0, {self.slots})")

    def _validate(
        self, slot: int, adapter: HostAdapter, room: Callable[[GroupBuffers], tuple[int, int]]
    ) -> None:
        """Refuse ``adapter`` for ``slot`` unless every module fits its group's buffers: the same widths,
        A's and B's ranks within ``room(buffers)`` (``(a_ranks, b_ranks)`` the slot holds)."""
        self._check_slot(slot)
        where = f"{self._what}: adapter {adapter.name!r} into slot {slot}"
        if adapter.targets is not self.targets and adapter.targets != self.targets:
            raise PoolError(f"{where}: it was loaded for different model targets than the pool's")
        if adapter.dtype != self.dtype:
            raise PoolError(f"{where}: host dtype {adapter.dtype} differs from the pool's {self.dtype}")
        if adapter.max_rank > self.max_rank:
            raise PoolError(f"{where}: rank {adapter.max_rank} exceeds the pool's max rank {self.max_rank}")
        if unfactored := [
            k for k, m in adapter.modules.items() if m.magnitude is not None and m.factor is None
        ]:
            module = adapter.modules[unfactored[0]]
            why = (
                "its row-parallel factors were not completed over the tensor-parallel ranks "
                "(Collective.finish_read)"
                if module.norm_parts is not None
                else "it is a DoRA adapter read without the model's base weights (read it through a "
                "HostTier given base_weights)"
            )
            raise PoolError(f"{where}: group {unfactored[0]!r} has no DoRA factor: {why}")
        for key, module in adapter.modules.items():
            group = module.group
            buf = self._buffers.get(key)
            n = group.n_slices
            a_room, b_room = (0, 0) if buf is None else room(buf)
            # A module fits when its widths are the buffers' and its ranks at most what the slot holds.
            fits = (
                buf is not None
                and module.a.shape[0] % n == 0
                and module.a.shape[0] // n <= a_room
                and module.a.shape[1] == buf.a.shape[2]
                and module.b.shape[0] == buf.b.shape[1]
                and module.b.shape[1] <= b_room
            )
            if not fits:
                expect = "none" if buf is None else f"[{n} x <={a_room}, {buf.a.shape[2]}]"
                raise PoolError(
                    f"{where}: group {key!r} has A {list(module.a.shape)} / B {list(module.b.shape)}, "
                    f"expected A {expect} / B [{buf.b.shape[1] if buf else '-'}, <={b_room}]"
                )

    def _copy(
        self, slot: int, adapter: HostAdapter, write: Callable[[bool], None]
    ) -> torch.cuda.Event | None:
        """Run ``write(non_blocking)`` for ``adapter`` into ``slot``, counted as a write of it: in place on
        CPU (None), on CUDA on the copy stream after the current stream's earlier work (which may still read
        the old occupant), the current stream waiting for it; returns the copy's end."""
        self._writes[slot] += 1
        if self._copy_stream is None:
            write(False)
            self._occupant[slot] = adapter.name
            return None
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            write(True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(done)
        self._in_flight[slot] = (done, adapter)
        self._occupant[slot] = adapter.name
        self._reap()
        return done

    def _reap(self) -> None:
        for slot in [s for s, (event, _) in self._in_flight.items() if event.query()]:
            del self._in_flight[slot]


def unit_nbytes(targets: LoRATargets, shapes: dict[str, tuple[int, int, int]], dtype: torch.dtype) -> int:
    """Device bytes of one slot (or page) of every group: A and B at ``shapes[key]`` ``(a_rank, b_out,
    b_rank)``, its ranks and scalings, a DoRA factor per output row and its flag."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(
        (g.n_slices * shapes[g.key][0] * g.in_features + shapes[g.key][1] * shapes[g.key][2]) * element
        + g.n_slices * 8
        + shapes[g.key][1] * element
        + 4
        for g in targets.groups
    )


def allocate_group(
    group: TargetGroup,
    units: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    page_rank: int | None = None,
    max_rank: int | None = None,
) -> GroupBuffers:
    """One group's zeroed buffers of ``units`` slots (or pages) at ``shape`` ``(a_rank, b_out, b_rank)``."""
    a_rank, b_out, b_rank = shape
    return GroupBuffers(
        group,
        torch.zeros((units, group.n_slices * a_rank, group.in_features), dtype=dtype, device=device),
        torch.zeros((units, b_out, b_rank), dtype=dtype, device=device),
        torch.zeros((units, group.n_slices), dtype=torch.int32, device=device),
        torch.zeros((units, group.n_slices), dtype=torch.float32, device=device),
        torch.ones((units, b_out), dtype=dtype, device=device),
        torch.zeros(units, dtype=torch.int32, device=device),
        set(),
        page_rank,
        max_rank,
    )


class DevicePool(SlotWrites):
    """``slots`` adapter slots on ``device`` for every target group, each holding ranks up to ``max_rank``.

    On CUDA, :meth:`fill` copies from (pinned) host memory on a side stream and makes the current stream
    wait for the copy; on CPU it copies in place. Each method validates everything before writing, so a
    refused call leaves the pool unchanged.
    """

    def __init__(
        self,
        targets: LoRATargets,
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        shards: ShardPlan[GroupCut] = WHOLE,
    ) -> None:
        """Allocate every buffer (zeroed), in the shapes ``shards`` gives (a tensor-parallel rank's shard of
        each group; the whole of it by default).

        Raises:
            PoolError: ``slots`` or ``max_rank`` is not positive, ``dtype`` is not floating point, or the
                allocation fails (the message gives the bytes asked for).
        """
        if slots <= 0 or max_rank <= 0:
            raise PoolError(f"device pool: slots ({slots}) and max_rank ({max_rank}) must both be positive")
        if not dtype.is_floating_point:
            raise PoolError(f"device pool: dtype must be floating point, got {dtype}")
        self._init_slots(targets, slots, max_rank, dtype, device)
        # (a_rank, b_out, b_rank) per group: A [slots, n_slices * a_rank, in], B [slots, b_out, b_rank].
        shapes = {g.key: shards.pool_shape(g, max_rank) for g in targets.groups}
        self.slot_nbytes = unit_nbytes(targets, shapes, dtype)
        try:
            self._buffers = {
                g.key: allocate_group(g, slots, shapes[g.key], dtype, self.device) for g in targets.groups
            }
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            raise PoolError(
                f"device pool: cannot allocate {slots} slots x {self.slot_nbytes} bytes on {self.device}: "
                f"{exc}"
            ) from None

    @property
    def nbytes(self) -> int:
        """Device bytes of every buffer of every slot."""
        return self.slots * self.slot_nbytes

    def device_nbytes(self, rank: int) -> int:
        """Device bytes an adapter of ``rank`` takes: a whole slot, whatever its rank."""
        return self.slot_nbytes

    def fill(self, slot: int, adapter: HostAdapter) -> torch.cuda.Event | None:
        """Copy ``adapter`` into ``slot``, zeroing every part of the slot it does not cover.

        On CUDA the copies are queued on a side stream (after the current stream's earlier work, which may
        still read the old occupant) and the current stream waits for them; the returned event marks their
        end. On CPU the copy is done when this returns, and the result is None.

        Raises:
            PoolError: ``slot`` out of range, or the adapter was loaded for other targets, another dtype or a
                rank above ``max_rank``; nothing is written then.
        """
        self._validate(slot, adapter, _slot_room)
        return self._copy(
            slot, adapter, lambda non_blocking: self._write(slot, adapter, non_blocking=non_blocking)
        )

    def clear(self, slot: int) -> None:
        """Zero every buffer of ``slot`` (weights, ranks and scalings) on the current stream.

        Raises:
            PoolError: ``slot`` is out of range.
        """
        self._check_slot(slot)
        self._writes[slot] += 1
        for buf in self._buffers.values():
            buf.a[slot].zero_()
            buf.b[slot].zero_()
            buf.ranks[slot].zero_()
            buf.scalings[slot].zero_()
            set_dora(buf, slot, None, non_blocking=False)
        self._occupant[slot] = None

    def _write(self, slot: int, adapter: HostAdapter, *, non_blocking: bool) -> None:
        modules = adapter.modules
        for key, buf in self._buffers.items():
            module: HostModule | None = modules.get(key)
            a_slot, b_slot = buf.a[slot], buf.b[slot]
            if module is None:
                a_slot.zero_()
                b_slot.zero_()
                buf.ranks[slot].zero_()
                buf.scalings[slot].zero_()
                set_dora(buf, slot, None, non_blocking=non_blocking)
                continue
            # A's and B's ranks differ on a fully sharded tensor-parallel rank; they are the same otherwise.
            n = buf.group.n_slices
            a_rank, b_rank = module.a.shape[0] // n, module.b.shape[1]
            if a_slot.shape[0] == module.a.shape[0]:
                a_slot.copy_(module.a, non_blocking=non_blocking)
            else:
                a_view = a_slot.view(n, a_slot.shape[0] // n, -1)
                a_view[:, :a_rank].copy_(module.a.view(n, a_rank, -1), non_blocking=non_blocking)
                a_view[:, a_rank:].zero_()
            if b_slot.shape[1] == b_rank:
                b_slot.copy_(module.b, non_blocking=non_blocking)
            else:
                b_slot[:, :b_rank].copy_(module.b, non_blocking=non_blocking)
                b_slot[:, b_rank:].zero_()
            set_slot_meta(buf, slot, module, non_blocking=non_blocking)


def _slot_room(buf: GroupBuffers) -> tuple[int, int]:
    """The ranks a slot holds in ``buf``: A's rows per slice and B's columns."""
    return buf.a.shape[1] // buf.group.n_slices, buf.b.shape[2]


def set_slot_meta(buf: GroupBuffers, slot: int, module: HostModule, *, non_blocking: bool) -> None:
    """Put ``module``'s ranks, scalings and DoRA factor into ``slot``'s entries of ``buf``."""
    buf.ranks[slot].copy_(module.rank_tensor, non_blocking=non_blocking)
    buf.scalings[slot].copy_(module.scaling_tensor, non_blocking=non_blocking)
    set_dora(buf, slot, module.factor, non_blocking=non_blocking)


def set_dora(buf: GroupBuffers, slot: int, factor: torch.Tensor | None, *, non_blocking: bool) -> None:
    """Put a DoRA module's ``factor`` (float32 ``[out]``) into ``slot`` of ``buf``, or mark the slot plain
    (factor 1, flag 0) when ``factor`` is None."""
    assert buf.factors is not None and buf.dora is not None and buf.dora_slots is not None
    if factor is None:
        if slot in buf.dora_slots:
            buf.factors[slot].fill_(1.0)
            buf.dora[slot].zero_()
            buf.dora_slots.discard(slot)
        return
    buf.factors[slot].copy_(factor, non_blocking=non_blocking)
    buf.dora[slot].fill_(1)
    buf.dora_slots.add(slot)
