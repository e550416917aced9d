"""One scheduler step as the manager hands it out: :class:`Step`, and how its arrays and request
indices are built from the core's plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_pin.errors import LoraPinError
from lora_pin.model.layers import StepSegments
from lora_pin.ops import SegmentBatch

__all__ = ["Step", "step_arrays"]


@dataclass(frozen=True, kw_only=True)
class Step:
    """One planned scheduler step (from :meth:`LoRAManager.prepare_step` or :meth:`LoRAManager.batch`).

    Attributes:
        admitted: indices (into the step's requests) of the requests that run this step, in batch order.
        deferred: indices of the requests that must wait for a later step (they hold nothing), in
            request order: resubmit them first, in this order. In background loading these include the
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
    """

    admitted: tuple[int, ...]
    deferred: tuple[int, ...]
    request_slots: torch.Tensor
    segments: SegmentBatch
    num_tokens: int
    _ticket: int
    _slot_writes: tuple[tuple[int, int], ...] = ()
    failed: Mapping[int, LoraPinError] = field(default_factory=dict)
    loading: tuple[int, ...] = ()
    reasons: tuple[str, ...] = ()


def step_arrays(
    plan: Any, device: torch.device, per_sequence: bool, chunk_size: int | None
) -> tuple[torch.Tensor, SegmentBatch, StepSegments]:
    """The core plan's arrays on ``device``: each admitted request's slot (int32 ``[len(admitted)]``, -1
    for base), the token segments, and the :class:`StepSegments` the LoRA layers read while it runs.

    The core hands every array in one buffer (``StepPlan.step_arrays``): one tensor, one copy to the
    device, and views of it.

    A per-sequence plan (:meth:`~lora_pin.model.LoRAManager.batch`) was made with one token per sequence:
    its segments serve decode inputs, and those of longer inputs are derived from them in the layers.
    """
    data, words = plan.step_arrays()
    if device.type == "cpu":
        # Views of the buffer, each by its own dtype: no copy (the tensors share the fresh bytearray).
        n_perm, n_requests, n_indptr, n_segments = words
        perm = _part(data, torch.int64, n_perm // 2, 0)
        at = 4 * n_perm
        request_slots = _part(data, torch.int32, n_requests, at)
        at += 4 * n_requests
        seg_indptr = _part(data, torch.int32, n_indptr, at)
        seg_slots = _part(data, torch.int32, n_segments, at + 4 * n_indptr)
    else:
        # One copy to the device, then views of it. Never empty: seg_indptr has its leading 0.
        flat = torch.frombuffer(data, dtype=torch.int32)
        # From pinned memory a CUDA copy is queued on the stream and the host goes on: a copy from
        # pageable memory would wait for every kernel already queued. (The caching host allocator keeps
        # the pinned block until the copy has run.)
        flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
        perm32, request_slots, seg_indptr, seg_slots = flat.split_with_sizes(words)
        perm = perm32.view(torch.int64)
    segments = SegmentBatch(perm, seg_indptr, seg_slots)
    any_adapter = words[0] > 0
    if per_sequence:
        active = StepSegments(
            segments, sequence_slots=request_slots.long(), chunk_size=chunk_size, any_adapter=any_adapter
        )
    else:
        active = StepSegments(segments=segments, any_adapter=any_adapter)
    return request_slots, segments, active


def _part(data: bytearray, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``data``, sharing its memory."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
