"""One scheduler step as the manager hands it out: :class:`Step`, and how its arrays and request
indices are built from the core's plan."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lora_pin.errors import LoraPinError, SpecError, UsageError
from lora_pin.model.layers import StepSegments
from lora_pin.ops import SegmentBatch

__all__ = ["HeldBack", "Step", "checked_names", "device_buffer", "request_indices", "step_arrays"]


@dataclass(frozen=True)
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
        failed: request index -> why its adapter could not be loaded (a background read that failed);
            these requests are neither admitted nor deferred. A later request for the adapter tries again.
        loading: the deferred requests whose adapter is not in host memory: being read in the background,
            or waiting for host memory to be read into (in request order; background loading only). They
            cost a step nothing until admitted: a scheduler may resubmit them without counting them
            against its batch budget.
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


def device_buffer(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer from the core as a tensor on ``device`` (no Python loop; empty buffers allowed)."""
    if len(data) == 0:
        return torch.empty(0, dtype=dtype, device=device)
    # The plan's getters hand out a fresh bytearray each call: the tensor may own it, no copy needed.
    host = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=dtype)
    if device.type == "cuda":
        # From pinned memory the copy is queued on the stream and the host goes on: a copy from pageable
        # memory would wait for every kernel already queued, once per array per step. (The caching host
        # allocator keeps the pinned block until the copy has run.)
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class HeldBack:
    """The requests of a background-loading step that the core does not see, by request index."""

    new: dict[str, Path]
    kept: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    failed: dict[int, LoraPinError] = field(default_factory=dict)


def step_arrays(
    plan: Any, device: torch.device, per_sequence: bool, chunk_size: int | None
) -> tuple[torch.Tensor, SegmentBatch, StepSegments]:
    """The core plan's arrays on ``device``: each admitted request's slot (int32 ``[len(admitted)]``, -1
    for base), the token segments, and the :class:`StepSegments` the LoRA layers read while it runs.

    A per-sequence plan (:meth:`~lora_pin.model.LoRAManager.batch`) was made with one token per sequence:
    its segments serve decode inputs, and those of longer inputs are derived from them in the layers.
    """
    request_slots = device_buffer(plan.request_slots, torch.int32, device)
    segments = SegmentBatch(
        device_buffer(plan.token_perm, torch.int32, device).long(),
        device_buffer(plan.seg_indptr, torch.int32, device),
        device_buffer(plan.seg_slots, torch.int32, device),
    )
    any_adapter = segments.perm.numel() > 0
    if per_sequence:
        active = StepSegments(
            segments, sequence_slots=request_slots.long(), chunk_size=chunk_size, any_adapter=any_adapter
        )
    else:
        active = StepSegments(segments=segments, any_adapter=any_adapter)
    return request_slots, segments, active


def request_indices(
    plan: Any, held: HeldBack | None
) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, LoraPinError]]:
    """``(admitted, deferred, failed)`` as indices into the step's requests. With ``held``, the core
    planned only the kept requests (its indices are positions among them), and the held-back ones are
    deferred (waiting for discovery) or failed (their adapter's read failed)."""
    admitted, deferred = tuple(plan.admitted), tuple(plan.deferred)
    if held is None:
        return admitted, deferred, {}
    kept = held.kept
    admitted = tuple(kept[i] for i in admitted)
    deferred = tuple(sorted([kept[i] for i in deferred] + held.waiting))
    return admitted, deferred, held.failed


def checked_names(names: Iterable[str | None]) -> list[str | None]:
    """``names`` as a list, each a str or None.

    Raises:
        UsageError: ``names`` is a str, or an entry is neither (named by its position).
        SpecError: an entry holds a lone surrogate (``json.loads`` gives one for ``"\\ud800"``): it has no
            UTF-8 encoding, so it can name no adapter or folder.
    """
    if isinstance(names, str):
        raise UsageError(f"names must be a sequence of adapter names, got the str {names!r}")
    names = list(names)
    for i, n in enumerate(names):
        if n is not None and not isinstance(n, str):
            raise UsageError(f"names[{i}] must be an adapter name (str) or None, got {type(n).__name__}")
        if n is not None and not n.isascii() and not _is_utf8(n):
            raise SpecError(f"names[{i}] {n!r} is not valid text: it holds a lone surrogate")
    return names


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
