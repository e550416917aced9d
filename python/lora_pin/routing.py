"""Which replica should serve a request: the replica routing rule of the Rust core, with typed stats.

A live request router and ``lora-pin simulate --replicas`` rank replicas with the same core function,
so what the simulator measures is what the router does. See :func:`rank_replicas` for the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lora_pin import _core

__all__ = ["Holding", "ReplicaStats", "home_replicas", "rank_replicas", "replication_factor"]

Holding = Literal["device", "host", "fetching", "absent"]
"""Where a replica holds the routed adapter: a device slot, host memory, being read from disk, or not."""


@dataclass(frozen=True)
class ReplicaStats:
    """One replica as the router sees it, for the adapter of the request being routed.

    Attributes:
        name: the replica's identity in rendezvous hashing; unique among the replicas.
        holding: where the replica holds the request's adapter (ignored for the base model and pins).
        free_slots: device slots that are free or hold an adapter no running request uses.
        queue: requests waiting or running on the replica.
        queue_bound: the queue length at which requests spill to the next choice (>= 1).
    """

    name: str
    holding: Holding
    free_slots: int
    queue: int
    queue_bound: int


def rank_replicas(
    adapter: str | None, replicas: Sequence[ReplicaStats], *, pinned: bool = False, homes: int = 1
) -> list[int]:
    """Ranks ``replicas`` for a request for ``adapter`` (None: the base model), best first.

    Returns every index into ``replicas`` once. The base model and ``pinned`` adapters (resident on
    every replica) go by load alone: shortest queue, then most free slots. Any other adapter prefers a
    replica holding it in a device slot, then in host memory or fetching it, then one of its ``homes``
    home replicas (rendezvous hashing of adapter and replica names, see :func:`home_replicas`) with a
    free slot, then the rest; least loaded first within each. A replica whose queue has reached its
    ``queue_bound`` goes behind every replica under its bound: requests spill to the next choice.

    Raises:
        SpecError: no replicas, a name given twice, an unknown holding, a queue bound of 0 or a
            negative count (each naming the replica), or ``homes`` below 1.
    """
    rows = [(r.name, r.holding, r.free_slots, r.queue, r.queue_bound) for r in replicas]
    return _core.rank_replicas(adapter, rows, pinned=pinned, homes=homes)


def replication_factor(share: float, replicas: int) -> int:
    """Home replicas for an adapter taking ``share`` (0..1) of the traffic among ``replicas`` replicas.

    ``ceil(share * replicas)`` clamped to ``1..replicas``: each home then receives at most about
    ``1 / replicas`` of all traffic from the adapter, so one popular adapter cannot swamp a replica,
    while a rare one keeps a single home and is loaded once.

    Raises:
        SpecError: ``share`` outside 0..1 or ``replicas`` below 1.
    """
    return _core.replication_factor(share, replicas)


def home_replicas(adapter: str, replicas: Sequence[str], homes: int) -> list[int]:
    """Indices into ``replicas`` (names) of ``adapter``'s ``homes`` home replicas, best first.

    Rendezvous hashing: the replicas with the highest hash of (adapter, replica name). Adding a
    replica changes only the homes it joins (about ``homes / (N + 1)`` of the adapters).

    Raises:
        SpecError: ``homes`` below 0.
    """
    return _core.home_replicas(adapter, list(replicas), homes)
