"""One scheduler step as the manager hands it out: :class:`Step`, and how its arrays are built from the
core's plan (:class:`StepArrays`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lora_pin.errors import LoraPinError
from lora_pin.model.segments import StepSegments, arrays_on
from lora_pin.ops import KernelMeta
from lora_pin.ops.paged import PageTable

__all__ = ["Step", "StepArrays", "step_segments"]


class Step:
    """One planned scheduler step (from :meth:`LoRAManager.prepare_step` or :meth:`LoRAManager.batch`),
    built by the manager (by position: a keyword call costs more, and every step builds one); its
    attributes are read-only (a plain class with ``__slots__``).

    Attributes:
        admitted: indices (into the step's requests) of the requests that run this step, in batch order.
        deferred: indices of the requests that must wait for a later step (they hold nothing), in
            request order (an engine offers its waiting requests in the core's order,
            :meth:`LoRAManager.offer_order`). In background loading these include the
            requests whose adapter is being read from disk.
        request_slots: int32 ``[len(admitted)]``, the device slot of each admitted request, -1 for base.
        segments: the token grouping the LoRA layers use; tokens are the admitted requests' tokens,
            each request's contiguous, in ``admitted`` order.
        num_tokens: ``T``, the admitted requests' tokens.
        failed: request index -> why it cannot run: its adapter's background read failed (a later
            request for the adapter tries again), or its adapter was unloaded while it waited. These
            requests are neither admitted nor deferred.
        loading: the deferred requests whose adapter is not in host memory: being read in the background,
            or waiting for host memory to be read into (in request order; background loading only). They
            cost a step nothing until admitted: a scheduler may resubmit them without counting them
            against its batch budget.
        reasons: why each deferred request waits, parallel to ``deferred``, as the core decided it:
            ``"device_room"``, ``"host_room"``, ``"loading"`` or ``"fairness"`` (see
            ``LoRARegistry.begin_step``).

    ``request_slots`` and ``segments`` may be the very tensors of an earlier step whose arrays were the
    same (:class:`StepArrays`): never write into them.
    """

    __slots__ = (
        "_plan",
        "_slot_writes",
        "_ticket",
        "admitted",
        "deferred",
        "failed",
        "loading",
        "num_tokens",
        "reasons",
        "request_slots",
        "segments",
    )

    def __init__(
        self,
        admitted: tuple[int, ...],
        deferred: tuple[int, ...],
        request_slots: torch.Tensor,
        segments: KernelMeta,
        num_tokens: int,
        _plan: Any,
        _slot_writes: tuple[tuple[int, int], ...] = (),
        failed: Mapping[int, LoraPinError] | None = None,
        loading: tuple[int, ...] = (),
        reasons: tuple[str, ...] = (),
    ) -> None:
        self.admitted = admitted
        self.deferred = deferred
        self.request_slots = request_slots
        self.segments = segments
        self.num_tokens = num_tokens
        # The core's plan (its arrays segment sub-batches) and its ticket (it ends the step).
        self._plan = _plan
        self._ticket: int = _plan.ticket
        self._slot_writes = _slot_writes
        self.failed: Mapping[int, LoraPinError] = {} if failed is None else failed
        self.loading = loading
        self.reasons = reasons

    def __repr__(self) -> str:
        return (
            f"Step(admitted={self.admitted}, deferred={self.deferred}, num_tokens={self.num_tokens}, "
            f"failed={dict(self.failed)}, loading={self.loading}, reasons={self.reasons})"
        )


class StepArrays:
    """The tensors of a step's arrays on ``device`` (from the core's ``StepPlan.step_arrays``), kept for
    the next step: a step whose arrays are byte for byte the last one's (a steady decode batch: the same
    requests in the same slots) gets the same tensors, built by no torch call at all.

    On CPU the tensors are views of the core's buffer, kept with them, so an in-place write into one
    would show in the comparison and end the reuse; on other devices each new buffer is one copy.
    Not thread-safe: one manager's steps run one at a time (its step lock).
    """

    __slots__ = ("_data", "_tensors", "_words", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._data: bytearray | None = None
        self._words: tuple[int, int, int, int] | None = None
        self._tensors: tuple[torch.Tensor, KernelMeta] | None = None

    def of(self, plan: Any) -> tuple[torch.Tensor, KernelMeta, bool]:
        """The arrays of ``plan`` (a ``StepPlan``) on the device: each admitted request's slot (int32
        ``[len(admitted)]``, -1 for base), the token segments, and whether any token uses an adapter."""
        data, words = plan.step_arrays()
        tensors = self._tensors
        # Only on CPU: a device copy made on one stream is not ordered before another stream's reads.
        if tensors is None or words != self._words or data != self._data or self.device.type != "cpu":
            tensors = arrays_on(data, words, self.device)
            self._data, self._words, self._tensors = data, words, tensors
        return tensors[0], tensors[1], words[0] > 0


def step_segments(
    sequence_slots: torch.Tensor,
    segments: KernelMeta,
    any_adapter: bool,
    chunk_size: int | None,
    pages: PageTable | None = None,
) -> StepSegments:
    """The :class:`StepSegments` of a per-sequence batch's arrays (:meth:`StepArrays.of`): its sequences'
    slots and the core's one-token segments (and a paged pool's page tables)."""
    return StepSegments(
        segments,
        sequence_slots=sequence_slots.long(),
        chunk_size=chunk_size,
        any_adapter=any_adapter,
        pages=pages,
    )
