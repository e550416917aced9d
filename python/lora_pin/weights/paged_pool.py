"""The device pool in rank pages (issue 37): per target group, a budget of pages instead of max-rank slots.

For each target group, allocated once (the paged layout of :mod:`lora_pin.ops.paged`):

* ``a``: ``[pages, n_slices * page_rank, in]``; page ``j`` of an adapter holds its ranks
  ``[j * page_rank, (j + 1) * page_rank)`` of every slice, slice s in rows ``[s * page_rank, (s + 1) *
  page_rank)``;
* ``b``: ``[pages, out_total, page_rank]``: the same ranks' B columns;
* ``ranks``, ``scalings``, ``factors``, ``dora``: one entry per page, as the slot pool's per slot. An
  adapter's *slot* is its first page (the core's ``StepPlan.page_table`` lists its pages in rank order);
  only that entry is set, the entries of its other pages are zero (rank 0), so every page that is no
  adapter's slot reads as empty.

An adapter of rank ``r`` takes ``ceil(r / page_rank)`` pages, not a max-rank slot, so a pool of rank-8
adapters under ``page_rank=8`` holds ``max_rank / 8`` times as many as slots of the same bytes. Its last
page's rows past ``r`` are zero, and groups it does not target are zero with rank 0.

Embeddings (their A is looked up by token id, not multiplied) and MoE expert weights (a slot holds every
expert's ranks) are not paged: a pool over them is refused by name. A tensor-parallel rank's pool holds
its shard of each group's widths; a fully sharded pool (its rank cut over the ranks) is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_pin.errors import PoolError
from lora_pin.weights.host_adapter import HostAdapter
from lora_pin.weights.pool import SlotWrites, allocate_group, set_dora, set_slot_meta, unit_nbytes
from lora_pin.weights.shards import WHOLE, GroupCut, ShardPlan
from lora_pin.weights.targets import LoRATargets

__all__ = ["PagedDevicePool", "pages_for"]


def pages_for(rank: int, page_rank: int) -> int:
    """Pages an adapter of ``rank`` takes: ``ceil(rank / page_rank)`` (the core's rule)."""
    return -(-rank // page_rank)


class PagedDevicePool(SlotWrites):
    """``pages`` rank pages of ``page_rank`` ranks on ``device`` for every target group; adapters up to
    ``max_rank``.

    Slots are pages: :meth:`occupant`, :meth:`writes` and the per-slot arrays are indexed by an adapter's
    first page. A write to any page of a slot counts as a write of that slot (a fill that takes a page
    another slot held counts for that slot too, and empties it), so a step that checks its slots' write
    counts notices. On CUDA, :meth:`fill` copies on a side stream as :class:`~lora_pin.weights.DevicePool`
    does. Each method validates everything before writing: a refused call leaves the pool unchanged.
    """

    _what = "paged device pool"

    def __init__(
        self,
        targets: LoRATargets,
        pages: int,
        page_rank: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        shards: ShardPlan[GroupCut] = WHOLE,
    ) -> None:
        """Allocate every buffer (zeroed).

        Raises:
            PoolError: ``pages``, ``page_rank`` or ``max_rank`` is not positive, ``dtype`` is not floating
                point, a group is an embedding or MoE expert weights (named), ``shards`` cuts a group's rank
                (fully sharded), or the allocation fails (the message gives the bytes asked for).
        """
        if pages <= 0 or page_rank <= 0 or max_rank <= 0:
            raise PoolError(
                f"paged device pool: pages ({pages}), page_rank ({page_rank}) and max_rank ({max_rank}) must "
                "all be positive"
            )
        if not dtype.is_floating_point:
            raise PoolError(f"paged device pool: dtype must be floating point, got {dtype}")
        for g in targets.groups:
            why = (
                "MoE expert weights hold every expert's ranks in one slot"
                if g.experts
                else "an embedding's A is looked up by token id, which the paged kernels do not do"
                if g.members[0].embedding
                else "its adapters' rank is cut over the tensor-parallel ranks (fully sharded)"
                if shards.cuts_rank(g)
                else None
            )
            if why is not None:
                raise PoolError(
                    f"paged device pool: target {g.key!r} cannot be paged: {why}; serve it with slots "
                    "(no page_rank / max_lora_memory) or leave it out of lora_target_modules"
                )
        self._init_slots(targets, pages, max_rank, dtype, device)
        self.page_rank = page_rank
        shapes = {g.key: shards.pool_shape(g, page_rank) for g in targets.groups}
        self.page_nbytes = unit_nbytes(targets, shapes, dtype)
        try:
            self._buffers = {
                g.key: allocate_group(g, pages, shapes[g.key], dtype, self.device, page_rank, max_rank)
                for g in targets.groups
            }
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            raise PoolError(
                f"paged device pool: cannot allocate {pages} pages x {self.page_nbytes} bytes on "
                f"{self.device}: {exc}"
            ) from None
        # Per slot: the pages it holds, in rank order (empty: no adapter's slot); per page: its slot.
        self._pages: list[tuple[int, ...]] = [()] * pages
        self._owner: list[int | None] = [None] * pages
        # Slots whose per-slot entries (ranks, scalings, DoRA) may be non-zero.
        self._live: set[int] = set()

    @staticmethod
    def page_bytes(
        targets: LoRATargets, page_rank: int, dtype: torch.dtype, shards: ShardPlan[GroupCut] = WHOLE
    ) -> int:
        """Device bytes of one page of a pool over ``targets`` (what ``max_lora_memory`` is divided by)."""
        return unit_nbytes(targets, {g.key: shards.pool_shape(g, page_rank) for g in targets.groups}, dtype)

    @property
    def pages(self) -> int:
        """Pages in the pool (the slot count of the per-slot arrays)."""
        return self.slots

    @property
    def nbytes(self) -> int:
        """Device bytes of every buffer of every page."""
        return self.slots * self.page_nbytes

    def device_nbytes(self, rank: int) -> int:
        """Device bytes an adapter of ``rank`` takes: its pages'."""
        return pages_for(rank, self.page_rank) * self.page_nbytes

    def pages_of(self, slot: int) -> tuple[int, ...]:
        """The pages ``slot``'s adapter holds, in rank order (empty when none).

        Raises:
            PoolError: ``slot`` is out of range.
        """
        self._check_slot(slot)
        return self._pages[slot]

    def live_slots(self) -> frozenset[int]:
        """The slots whose per-slot entries may be set (filled, not released since)."""
        return frozenset(self._live)

    def fill(
        self, slot: int, adapter: HostAdapter, pages: Sequence[int] | None = None
    ) -> torch.cuda.Event | None:
        """Copy ``adapter`` into ``pages`` (its page table, in rank order, the first being ``slot``; None:
        the pages ``slot`` holds now, to refresh it), zeroing the rows of its last page past its rank and
        every group it does not target. A page's entries are non-zero only while it is a filled slot (a
        slot whose page another fill takes is emptied first), so those of ``pages[1:]`` read rank 0.

        On CUDA the copies are queued on a side stream as :meth:`DevicePool.fill` does and the returned
        event marks their end; on CPU the copy is done when this returns (None).

        Raises:
            PoolError: ``slot`` out of range; ``pages`` empty, not starting at ``slot``, repeating a page,
                out of range or holding fewer ranks than the adapter's; or the adapter was loaded for other
                targets, another dtype or a rank above ``max_rank``. Nothing is written then.
        """
        self._check_slot(slot)
        table = self._pages[slot] if pages is None else tuple(pages)
        where = f"paged device pool: adapter {adapter.name!r} into slot {slot}"
        if (
            not table
            or table[0] != slot
            or len(set(table)) != len(table)
            or any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.slots for p in table)
        ):
            raise PoolError(
                f"{where}: pages {list(table)} must be distinct pages in [0, {self.slots}), the first being "
                "the slot"
            )
        room = len(table) * self.page_rank
        needs = pages_for(adapter.max_rank, self.page_rank)
        if needs > len(table):
            raise PoolError(
                f"{where}: rank {adapter.max_rank} needs {needs} pages of page_rank={self.page_rank}, "
                f"given {len(table)}"
            )
        self._validate(slot, adapter, lambda _buf: (room, room))
        # Pages another slot held: that slot's contents are gone (its count moves, its entries are zeroed).
        for other in {self._owner[p] for p in table} - {None, slot}:
            assert other is not None
            self._writes[other] += 1
            self._occupant[other] = None
            self._release_entries(other, non_blocking=False)
            for p in self._pages[other]:
                self._owner[p] = None
            self._pages[other] = ()
        for p in self._pages[slot]:
            self._owner[p] = None
        self._pages[slot] = table
        for p in table:
            self._owner[p] = slot
        return self._copy(slot, adapter, lambda non_blocking: self._write(slot, adapter, table, non_blocking))

    def clear(self, slot: int) -> None:
        """Zero ``slot``'s pages and entries on the current stream; its pages are then no slot's.

        Raises:
            PoolError: ``slot`` is out of range.
        """
        self._check_slot(slot)
        self._writes[slot] += 1
        table = self._pages[slot]
        if table:
            index = torch.tensor(table, dtype=torch.long, device=self.device)
            for buf in self._buffers.values():
                buf.a.index_fill_(0, index, 0)
                buf.b.index_fill_(0, index, 0)
        self._release_entries(slot, non_blocking=False)
        for p in table:
            self._owner[p] = None
        self._pages[slot] = ()
        self._occupant[slot] = None

    def release(self, slot: int) -> None:
        """Mark ``slot`` empty without touching its pages' weights (the core freed its pages: a later fill
        overwrites them): its entries are zeroed, so it reads as rank 0, and it counts as written.

        Raises:
            PoolError: ``slot`` is out of range.
        """
        self._check_slot(slot)
        self._writes[slot] += 1
        self._release_entries(slot, non_blocking=False)
        for p in self._pages[slot]:
            self._owner[p] = None
        self._pages[slot] = ()
        self._occupant[slot] = None

    def _release_entries(self, slot: int, *, non_blocking: bool) -> None:
        if slot not in self._live:
            return
        for buf in self._buffers.values():
            buf.ranks[slot].zero_()
            buf.scalings[slot].zero_()
            set_dora(buf, slot, None, non_blocking=non_blocking)
        self._live.discard(slot)

    def _write(self, slot: int, adapter: HostAdapter, table: tuple[int, ...], non_blocking: bool) -> None:
        page_rank, count = self.page_rank, len(table)
        # Live before any entry is written: a write that fails half-way leaves entries a clear must zero.
        self._live.add(slot)
        index = torch.tensor(table, dtype=torch.long)
        index = (
            index.pin_memory().to(self.device, non_blocking=True) if non_blocking else index.to(self.device)
        )
        for key, buf in self._buffers.items():
            module = adapter.modules.get(key)
            if module is None:
                buf.a.index_fill_(0, index, 0)
                buf.b.index_fill_(0, index, 0)
                buf.ranks[slot].zero_()
                buf.scalings[slot].zero_()
                set_dora(buf, slot, None, non_blocking=non_blocking)
                continue
            n, width = buf.group.n_slices, count * page_rank
            a_rank, b_rank = module.a.shape[0] // n, module.b.shape[1]
            # The adapter's ranks padded with zeros to whole pages, then cut into its pages.
            a = buf.a.new_zeros((n, width, buf.a.shape[2]))
            a[:, :a_rank].copy_(module.a.view(n, a_rank, -1), non_blocking=non_blocking)
            a_pages = a.view(n, count, page_rank, -1).transpose(0, 1).reshape(count, n * page_rank, -1)
            buf.a.index_copy_(0, index, a_pages)
            b = buf.b.new_zeros((buf.b.shape[1], width))
            b[:, :b_rank].copy_(module.b, non_blocking=non_blocking)
            buf.b.index_copy_(0, index, b.view(b.shape[0], count, page_rank).transpose(0, 1).contiguous())
            set_slot_meta(buf, slot, module, non_blocking=non_blocking)
