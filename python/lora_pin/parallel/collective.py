"""Ranks agree: one small all-reduce settles whether an operation succeeded on every rank.

An adapter load reads each rank's own shard from disk, so it can fail on one rank only (its part of the file
holds a NaN, its disk copy is damaged). Each rank first does everything that can fail without changing any
state (the read and its checks), then :func:`agree` all-reduces one int64 status per rank: if any rank
failed, every rank raises the same error class and none registers anything; otherwise every rank commits.
The same all-reduce carries a fresh id drawn by rank 0, so a run-time load has one id on every rank.

Background reads end at a different time on each rank, so :func:`agree_fetches` settles, where a step
installs finished reads, which fetches are over on every rank: one all-reduce of a status per fetch and rank
(running, read, or failed with an error class), the fetches being listed alike on every rank.

What comes after the agreement (the registry's plan, admission, slots, evictions) is a pure function of the
registered adapters and the step's inputs, so the ranks stay in step without any further collective.

:class:`CollectiveLog` counts the collectives lora_pin runs (not the base layers'), for ``stats()``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from lora_pin.errors import (
    AdapterInUseError,
    AdapterLoadError,
    AdapterNotFoundError,
    CapacityError,
    DuplicateAdapterError,
    LoraPinError,
    PathNotAllowedError,
    SpecError,
    UnsafeFormatError,
)
from lora_pin.parallel.sharding import TensorParallel

__all__ = [
    "READ",
    "RUNNING",
    "Agreement",
    "CollectiveLog",
    "agree",
    "agree_fetches",
    "agreed",
    "fetch_agreements",
    "fetch_status",
]

T = TypeVar("T")

# Status codes, most specific first: 0 is success; an error is coded by the first class it is an instance of.
_ERRORS: tuple[type[LoraPinError], ...] = (
    PathNotAllowedError,
    UnsafeFormatError,
    AdapterLoadError,
    DuplicateAdapterError,
    AdapterNotFoundError,
    CapacityError,
    AdapterInUseError,
    SpecError,
    LoraPinError,
)


@dataclass
class CollectiveLog:
    """Collectives lora_pin ran (not the base layers'): calls and bytes sent per kind, this rank."""

    calls: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        """Count one ``kind`` collective sending ``tensor`` (its bytes)."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.nbytes[kind] = self.nbytes.get(kind, 0) + tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        """Zero every count."""
        self.calls.clear()
        self.nbytes.clear()


class Agreement:
    """The outcome of :func:`agree`: ``failed`` ranks (with their codes) and the id rank 0 drew."""

    def __init__(self, codes: list[int], token: str) -> None:
        self.codes = codes
        self.token = token

    @property
    def failed(self) -> list[int]:
        """The ranks whose part failed."""
        return [r for r, c in enumerate(self.codes) if c]

    def raise_if_failed(self, what: str, mine: BaseException | None) -> None:
        """Raise ``mine`` on a rank that failed; on the others, an error of the first failed rank's class.

        Raises:
            LoraPinError: (the subclass of the first failed rank's error) when any rank failed.
        """
        error = self.error(what, mine)
        if error is not None:
            raise error

    def error(self, what: str, mine: BaseException | None) -> BaseException | None:
        """What :meth:`raise_if_failed` raises (``mine`` on a rank that failed), or None when no rank did."""
        failed = self.failed
        if not failed:
            return None
        if mine is not None:
            return mine
        cls = _ERRORS[self.codes[failed[0]] - 1]
        return cls(
            f"{what}: refused on every tensor-parallel rank because it failed on rank(s) {failed} "
            f"({cls.__name__}; the reason is in that rank's error); nothing changed"
        )


def _code(error: BaseException | None) -> int:
    if error is None:
        return 0
    for i, cls in enumerate(_ERRORS):
        if isinstance(error, cls):
            return i + 1
    return len(_ERRORS)


def agree(tp: TensorParallel, error: BaseException | None, log: CollectiveLog | None = None) -> Agreement:
    """All-reduce this rank's status (``error``: None for success) with every rank's, in one call of
    ``tp.size + 2`` int64; returns the :class:`Agreement`, carrying a fresh 128-bit id from rank 0.

    Must be called by every rank of ``tp.group``, in the same order.
    """
    status = torch.zeros(tp.size + 2, dtype=torch.int64)
    status[tp.rank] = _code(error)
    if tp.rank == 0:
        status[tp.size] = secrets.randbits(62)
        status[tp.size + 1] = secrets.randbits(62)
    if log is not None:
        log.add("agree", status)
    dist.all_reduce(status, group=tp.group)
    values = status.tolist()
    token = f"{values[tp.size]:016x}{values[tp.size + 1]:016x}"
    return Agreement(values[: tp.size], token)


#: A fetch's state on one rank, for :func:`agree_fetches`: its read still runs (or waits to start).
RUNNING = False
#: ... and: its read finished and passed every check.
READ = True


def agree_fetches(
    tp: TensorParallel, outcomes: Sequence[bool | BaseException], log: CollectiveLog | None = None
) -> list[Agreement | None]:
    """Agree with every rank on which of a list of fetches are over, in one all-reduce of
    ``len(outcomes) * tp.size`` int64.

    Args:
        outcomes: this rank's state of each fetch, listed in the same order on every rank:
            :data:`RUNNING`, :data:`READ`, or the exception its read failed with.

    Returns:
        Per fetch: None while it runs on some rank and failed on none (it stays fetching); else an
        :class:`Agreement` (no ``token``) whose ``failed`` is empty when it was read on every rank, and
        names the ranks where it failed otherwise (it fails on every rank: :meth:`Agreement.error`).

    Must be called by every rank of ``tp.group``, in the same order, with as many outcomes.
    """
    status = torch.zeros(len(outcomes), tp.size, dtype=torch.int64)
    for i, outcome in enumerate(outcomes):
        status[i, tp.rank] = fetch_status(outcome)
    if log is not None:
        log.add("agree_fetches", status)
    dist.all_reduce(status, group=tp.group)
    return fetch_agreements(status.tolist())


def fetch_status(outcome: bool | BaseException) -> int:
    """One process's state of a fetch as :func:`agree_fetches` sends it: 0 running, 1 read, 1 + the
    error's code when its read failed."""
    return int(outcome) if isinstance(outcome, bool) else 1 + _code(outcome)


def fetch_agreements(rows: Sequence[Sequence[int]]) -> list[Agreement | None]:
    """Per fetch, from every process's :func:`fetch_status` of it (one row per fetch, one column per
    process), what :func:`agree_fetches` returns."""
    agreements: list[Agreement | None] = []
    for row in rows:
        if any(c > 1 for c in row):
            agreements.append(Agreement([c - 1 if c > 1 else 0 for c in row], ""))
        elif all(c == 1 for c in row):
            agreements.append(Agreement([0] * len(row), ""))
        else:
            agreements.append(None)
    return agreements


def agreed(
    tp: TensorParallel,
    what: str,
    run: Callable[[], T],
    log: CollectiveLog | None = None,
    undo: Callable[[], None] | None = None,
) -> tuple[T, Agreement]:
    """``run()`` on this rank, then :func:`agree` with every rank on its outcome: returns its value and the
    :class:`Agreement` (whose ``token`` is the shared fresh id) when it succeeded on every rank.

    Call it with a ``run`` that changes nothing that matters to the ranks' agreement (a read and its
    checks), or give ``undo``, which reverts it where it succeeded when another rank failed.

    Raises:
        LoraPinError: (or this rank's own exception) when ``run`` failed on any rank; ``what`` names the
            operation in the other ranks' message.
    """
    value: T | None = None
    error: Exception | None = None
    try:
        value = run()
    except Exception as exc:  # any failure: the other ranks must not wait for this one
        error = exc
    agreement = agree(tp, error, log)
    if agreement.failed and error is None and undo is not None:
        undo()
    agreement.raise_if_failed(what, error)
    return value, agreement  # type: ignore[return-value]
