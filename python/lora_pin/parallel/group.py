"""The one seam between a manager and tensor parallelism: a :class:`Collective` it calls unconditionally.

Every state change a manager makes (a load, a pin, an unload, a read into the host tier) runs through
:meth:`Collective.agreed`. On one process (:class:`SingleProcess`) that is the operation itself, nothing
more. Over a tensor-parallel group (:class:`TensorParallelGroup`) every rank runs its part and the ranks
agree on the outcome (:func:`~lora_pin.parallel.collective.agreed`): all commit or all raise. So the
manager's code reads the same either way, with no branch on the mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lora_pin.parallel.collective import (
    Agreement,
    CollectiveLog,
    agree_fetches,
    agreed,
    fetch_agreements,
    fetch_status,
)
from lora_pin.parallel.identity import agree_identity
from lora_pin.parallel.sharding import TensorParallel
from lora_pin.weights.dora import finish_factors
from lora_pin.weights.host_adapter import HostAdapter

__all__ = ["Collective", "SingleProcess", "TensorParallelGroup"]

T = TypeVar("T")


class Collective(ABC):
    """How a manager's operations agree over the processes serving one model.

    Attributes:
        tp: this process's place in its tensor-parallel group; None on one process.
        log: the collectives run (:class:`~lora_pin.parallel.collective.CollectiveLog`); None on one
            process, which runs none.
        steps_may_read: whether a step may read an adapter from disk inside its own transaction: on one
            process it may (a last resort when other threads keep evicting what it needs); over ranks a
            read inside a step would be one rank's alone, so a step that cannot bring its adapters into
            host memory first fails instead.
        reads_end_apart: whether the processes' background reads of one fetch end at times of their own,
            so that each install first agrees on which are over (:meth:`agree_fetches`); on one process a
            read is installed as it ends.
    """

    tp: TensorParallel | None = None
    log: CollectiveLog | None = None
    steps_may_read = True
    reads_end_apart = False

    @abstractmethod
    def agreed(
        self, what: str, run: Callable[[], T], undo: Callable[[], None] | None = None
    ) -> tuple[T, str | None]:
        """``run()``; over ranks, agreed with every rank (``undo`` reverts it where it succeeded when
        another rank failed). Returns its value and the fresh id rank 0 drew (None on one process).

        Raises:
            LoraPinError: over ranks, one of the failed rank's class when ``run`` failed on another rank
                (``what`` names the operation then); and whatever ``run`` raises.
        """

    @abstractmethod
    def agree_identity(self, what: str, digest: str, whole_bytes: int) -> None:
        """Check every rank read the same adapter (``digest``, 64 hex characters, and ``whole_bytes``).

        Raises:
            AdapterLoadError: over ranks, when two ranks read different adapters.
        """

    @abstractmethod
    def agree_fetches(self, outcomes: Sequence[bool | BaseException]) -> list[Agreement | None]:
        """Which background reads are over on every process: per fetch (listed alike on every process,
        with this one's :data:`~lora_pin.parallel.collective.RUNNING`, :data:`~lora_pin.parallel.collective.
        READ` or the exception its read failed with), None while it runs somewhere and failed nowhere, else
        an :class:`~lora_pin.parallel.collective.Agreement` naming the processes where it failed (none:
        read everywhere)."""

    def finish_read(self, adapter: HostAdapter) -> HostAdapter:
        """What a read leaves to the ranks together, done once every rank's read of ``adapter`` is agreed:
        a DoRA adapter's row-parallel factors, from every rank's part of their squared norms
        (:func:`~lora_pin.weights.dora.finish_factors`; on one process nothing is left). Over ranks, every
        rank calls it for the same adapters in the same order, as every agreement.

        Raises:
            AdapterLoadError: a norm is zero or a factor out of range (alike on every rank).
        """
        return finish_factors(adapter, self._sum)

    @abstractmethod
    def _sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the processes serving the model, in place."""

    def stats(self) -> dict[str, Any]:
        """The collectives run so far, for ``LoRAManager.stats()`` (empty on one process)."""
        return {}


class SingleProcess(Collective):
    """One process: every operation is its own agreement."""

    def agreed(
        self, what: str, run: Callable[[], T], undo: Callable[[], None] | None = None
    ) -> tuple[T, str | None]:
        """``run()``, and no id (see :meth:`Collective.agreed`)."""
        return run(), None

    def agree_identity(self, what: str, digest: str, whole_bytes: int) -> None:
        """Nothing to compare with (see :meth:`Collective.agree_identity`)."""

    def agree_fetches(self, outcomes: Sequence[bool | BaseException]) -> list[Agreement | None]:
        """Each read is over when it is over here (see :meth:`Collective.agree_fetches`)."""
        return fetch_agreements([[fetch_status(outcome)] for outcome in outcomes])

    def _sum(self, tensor: torch.Tensor) -> None:
        """One process's sum is its own tensor."""

    def __repr__(self) -> str:
        return "SingleProcess()"


class TensorParallelGroup(Collective):
    """This rank of a tensor-parallel group: every operation is agreed with the other ranks, which must
    call the same operations in the same order.

    Args:
        tp: this rank's place in the group.
    """

    steps_may_read = False
    reads_end_apart = True

    def __init__(self, tp: TensorParallel) -> None:
        self.tp: TensorParallel = tp
        self.log: CollectiveLog = CollectiveLog()

    def agreed(
        self, what: str, run: Callable[[], T], undo: Callable[[], None] | None = None
    ) -> tuple[T, str | None]:
        """:func:`~lora_pin.parallel.collective.agreed` over the group (see :meth:`Collective.agreed`)."""
        value, agreement = agreed(self.tp, what, run, self.log, undo)
        return value, agreement.token

    def agree_identity(self, what: str, digest: str, whole_bytes: int) -> None:
        """:func:`~lora_pin.parallel.identity.agree_identity` over the group."""
        agree_identity(self.tp, what, digest, whole_bytes, self.log)

    def agree_fetches(self, outcomes: Sequence[bool | BaseException]) -> list[Agreement | None]:
        """:func:`~lora_pin.parallel.collective.agree_fetches` over the group: which background reads
        are over on every rank."""
        return agree_fetches(self.tp, outcomes, self.log)

    def _sum(self, tensor: torch.Tensor) -> None:
        self.log.add("dora_norms", tensor)
        dist.all_reduce(tensor, group=self.tp.group)

    def stats(self) -> dict[str, Any]:
        """Calls and bytes of the collectives lora_pin ran, per kind, this rank."""
        return {"tp_collective_calls": dict(self.log.calls), "tp_collective_bytes": dict(self.log.nbytes)}

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.tp.rank}, size={self.tp.size})"
