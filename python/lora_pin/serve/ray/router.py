"""lora_pin deciding placement inside Ray Serve: a request router over each replica's placement snapshot.

Ray Serve asks a deployment's request router (``ray.serve.request_router.RequestRouter``) to rank the
replicas for every request, and offers each replica's own ``record_routing_stats()`` to it as
``RunningReplica.routing_stats``. Each lora_pin replica reports its manager's placement snapshot there
(:func:`replica_stats`); :class:`LoRARouter` turns the snapshots into :class:`~lora_pin.routing.ReplicaStats`
and ranks them with :func:`lora_pin.routing.rank_replicas`, the same rule ``lora-pin simulate --replicas``
measures:

1. pinned adapters (resident on every replica) and the base model: by load alone;
2. any other adapter: a replica holding it in a device slot, then in host memory or fetching it, then
   its home replicas (rendezvous hashing) with a free slot, then the least loaded; a replica whose
   queue has reached the bound spills to the next choice;
3. popular adapters get more homes: ``replication_factor`` of their share of the recent requests.

Snapshots arrive every ``request_routing_stats_period_s`` (a second by default here), so the router also
remembers where it sent each adapter lately (as ``fetching`` there: it is being loaded) and counts its own
requests in flight per replica (the queue), both exact in the ingress's process.

An adapter's requests go only to replicas that report serving it at the deployment's desired version
(:func:`lora_pin.serve.ray.desired.serves_at` on each replica's ``serves``): a replica that started again
or missed a change takes none of them until it has caught up. Reports come with the routing stats and,
fresher, with every answer to the ingress's adapter changes (:meth:`LoRARouter.note`); the newest wins.

A request may also name one replica (:attr:`RouteHint.replica`): the ingress uses that to apply a load,
unload or pin to every replica in turn; or name replicas to avoid (:attr:`RouteHint.exclude`): those a
retried request already failed on.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import RequestRouter

from lora_pin.routing import Holding, ReplicaStats, rank_replicas, replication_factor
from lora_pin.serve.ray.desired import serves_at

__all__ = ["AffinityRanker", "LoRARouter", "RouteHint", "replica_stats"]

# What a placement tier means to the router; "disk" (evicted) is as good as absent.
_HOLDING: dict[str, Holding] = {"device": "device", "host": "host", "fetching": "fetching"}


@dataclass(frozen=True)
class RouteHint:
    """What the router needs to know about one request, passed as the ``route`` keyword of the call.

    Attributes:
        adapter: the adapter the request names; None for the base model (or a request that names no
            model the ingress knows: any replica answers it the same way).
        pinned: the adapter is pinned on every replica (routed by load alone).
        version: the adapter's desired version: only replicas serving it at that version or newer take
            the request (None: any replica).
        replica: send to this replica only (its name, ``ReplicaID.unique_id``); None: rank them all.
        exclude: replicas not to send it to (a retry avoids those it failed on).
    """

    adapter: str | None = None
    pinned: bool = False
    version: int | None = None
    replica: str | None = None
    exclude: tuple[str, ...] = ()


def replica_stats(name: str, placement: Any, queue: int) -> dict[str, Any]:
    """A replica's routing stats from its manager's ``placement()`` snapshot (None: LoRA is off).

    Returns ``{"replica": name, "free_slots": int, "queue": int, "holding": {adapter: tier}}``: plain
    data, as Ray Serve ships it to every router. ``free_slots`` counts slots that are free or hold an
    adapter that is neither pinned nor in use (a load there evicts nothing anyone waits on).
    """
    if placement is None:
        return {"replica": name, "free_slots": 0, "queue": queue, "holding": {}}
    busy = sum(1 for a in placement.adapters if a.tier == "device" and (a.pinned or a.in_flight > 0))
    holding = {a.name: a.tier for a in placement.adapters if a.tier in _HOLDING}
    return {
        "replica": name,
        "free_slots": max(0, placement.slots - busy),
        "queue": queue,
        "holding": holding,
    }


class AffinityRanker:
    """The router's memory and ranking, apart from Ray so it can be tested on fabricated stats.

    Args:
        queue_bound: queued and running requests at which a replica spills to the next choice (>= 1).
        memory_s: how long a request sent to a replica counts as its adapter being fetched there (until
            the replica's own snapshot says where it is).
        window: how many recent requests make up each adapter's share of the traffic.
        clock: seconds, monotonic (tests pass their own).

    Raises:
        ValueError: ``queue_bound`` or ``window`` below 1, or ``memory_s`` negative.
    """

    def __init__(
        self,
        queue_bound: int = 8,
        memory_s: float = 3.0,
        window: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if queue_bound < 1 or window < 1 or memory_s < 0:
            raise ValueError(
                f"queue_bound and window must be at least 1 and memory_s at least 0 "
                f"(got {queue_bound}, {window}, {memory_s})"
            )
        self.queue_bound = queue_bound
        self.memory_s = memory_s
        self._clock = clock
        self._recent: deque[tuple[str, str | None]] = deque(maxlen=window)
        self._seen: set[str] = set()
        self._counts: Counter[str | None] = Counter()
        self._sent: dict[tuple[str, str], float] = {}
        self.in_flight: Counter[str] = Counter()

    def homes(self, adapter: str, replicas: int) -> int:
        """Home replicas for ``adapter`` from its share of the recent requests."""
        total = len(self._recent)
        share = self._counts[adapter] / total if total else 0.0
        return replication_factor(min(1.0, share), max(1, replicas))

    def rank(
        self,
        hint: RouteHint,
        replicas: Sequence[tuple[str, Mapping[str, Any]]],
        request_id: str | None = None,
    ) -> list[int]:
        """Ranks ``replicas`` (name, routing stats) for a request, best first, by index; only the named
        replica's when ``hint.replica`` is set (none if it is not among them).

        Replicas in ``hint.exclude`` are left out. With ``hint.version`` set, so are those whose stats'
        ``serves`` lack ``hint.adapter`` at that version, unless none has it (a report not yet here:
        whichever replica answers, the ingress sees its answer). The first time a ``request_id`` is
        ranked it counts in its adapter's share of the traffic, and the adapter counts as fetching on the
        first choice for ``memory_s``. Stats a replica has not reported yet count as holding nothing,
        with one free slot.
        """
        if hint.replica is not None:
            return [i for i, (name, _) in enumerate(replicas) if name == hint.replica]
        kept = [i for i, (name, _) in enumerate(replicas) if name not in hint.exclude]
        if hint.adapter is not None and hint.version is not None:
            adapter, version = hint.adapter, hint.version
            serving = [i for i in kept if serves_at(replicas[i][1].get("serves", {}), adapter, version)]
            kept = serving or kept
        if not kept:
            return []
        now = self._clock()
        rows = []
        for name, stats in (replicas[i] for i in kept):
            holding: Holding = "absent"
            if hint.adapter is not None:
                holding = _HOLDING.get(stats.get("holding", {}).get(hint.adapter, ""), "absent")
                if holding == "absent" and self._sent.get((name, hint.adapter), -1.0) > now - self.memory_s:
                    holding = "fetching"
            rows.append(
                ReplicaStats(
                    name=name,
                    holding=holding,
                    free_slots=int(stats.get("free_slots", 1)),
                    queue=self.in_flight[name],
                    queue_bound=self.queue_bound,
                )
            )
        homes = 1 if hint.adapter is None else self.homes(hint.adapter, len(rows))
        order = rank_replicas(hint.adapter, rows, pinned=hint.pinned, homes=homes)
        if request_id is not None and request_id not in self._seen:
            self._count(request_id, hint.adapter)
            if hint.adapter is not None and not hint.pinned:
                self._sent[(rows[order[0]].name, hint.adapter)] = now
        return [kept[i] for i in order]

    def _count(self, request_id: str, adapter: str | None) -> None:
        if len(self._recent) == self._recent.maxlen:
            oldest_id, oldest = self._recent[0]
            self._seen.discard(oldest_id)
            self._counts[oldest] -= 1
            if self._counts[oldest] <= 0:
                del self._counts[oldest]
        self._recent.append((request_id, adapter))
        self._seen.add(request_id)
        self._counts[adapter] += 1

    def sent(self, replica: str) -> None:
        """A request went to ``replica``: one more in its queue."""
        self.in_flight[replica] += 1

    def completed(self, replica: str) -> None:
        """A request on ``replica`` ended (answered, failed or cancelled)."""
        self.in_flight[replica] -= 1
        if self.in_flight[replica] <= 0:
            del self.in_flight[replica]

    def forget(self, live: set[str]) -> None:
        """Drop what is remembered of replicas no longer in ``live``."""
        for key in [k for k in self._sent if k[0] not in live]:
            del self._sent[key]
        for name in [n for n in self.in_flight if n not in live]:
            del self.in_flight[name]


# Every LoRARouter living in this process, by (application, deployment).
_ROUTERS: dict[tuple[str, str], LoRARouter] = {}


def _live_routers() -> dict[tuple[str, str], LoRARouter]:
    """This process's routers. Ray Serve ships the router class to each process by value (a copy of the
    class and of the globals its methods use), so the registry is looked up in the module as imported
    here, where the ingress finds it too."""
    module = importlib.import_module(__name__)
    routers: dict[tuple[str, str], LoRARouter] = module._ROUTERS
    return routers


def _hint_of(pending_request: Any) -> RouteHint:
    # Read field by field: the router's copy of RouteHint (shipped by value) is not the caller's class.
    hint = None if pending_request is None else pending_request.kwargs.get("route")
    if hint is None:
        return RouteHint()
    version = getattr(hint, "version", None)
    return RouteHint(
        adapter=getattr(hint, "adapter", None),
        pinned=bool(getattr(hint, "pinned", False)),
        version=None if version is None else int(version),
        replica=getattr(hint, "replica", None),
        exclude=tuple(getattr(hint, "exclude", ())),
    )


class LoRARouter(RequestRouter):  # type: ignore[misc, valid-type]
    """Ray Serve's request router for lora_pin replicas (set it in the deployment's
    ``RequestRouterConfig``; ``request_router_kwargs``: ``queue_bound``, ``memory_s``, ``window``).

    Thread safety: Ray Serve runs the router on a loop of its own; :meth:`note` and :meth:`report` may be
    called from any thread."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Ray Serve's hook: the ranker's settings from ``request_router_kwargs``."""
        self.ranker = AffinityRanker(
            queue_bound=int(kwargs.get("queue_bound", 8)),
            memory_s=float(kwargs.get("memory_s", 3.0)),
            window=int(kwargs.get("window", 1000)),
        )
        self._noted: dict[str, dict[str, Any]] = {}
        self._noted_lock = threading.Lock()
        deployment = self._deployment_id
        _live_routers()[(deployment.app_name, deployment.name)] = self

    @classmethod
    def of(cls, app_name: str, deployment: str) -> LoRARouter | None:
        """The router of ``deployment`` in ``app_name`` living in this process (None before its first
        request from here)."""
        return _live_routers().get((app_name, deployment))

    def replica_names(self) -> list[str]:
        """The names (``ReplicaID.unique_id``) of the replicas running now, as Ray Serve last said."""
        return sorted(r.unique_id for r in list(self.curr_replicas))

    def note(self, replica: str, report: Mapping[str, Any]) -> None:
        """Keep ``report`` (a replica's ``record_routing_stats()`` shape, with its ``at``) as what
        ``replica`` serves, unless a newer one is known."""
        with self._noted_lock:
            known = self._noted.get(replica)
            if known is None or int(report.get("at", 0)) >= int(known.get("at", 0)):
                self._noted[replica] = dict(report)

    def report(self, replica: str) -> dict[str, Any] | None:
        """The newest report of ``replica``: its last routing stats or the last :meth:`note`, whichever
        the replica made later (None: neither yet)."""
        stats = None
        for replica_id, running in list(self.curr_replicas.items()):
            if replica_id.unique_id == replica:
                stats = running.routing_stats or None
        return self._newest(replica, stats)

    def _newest(self, replica: str, stats: Mapping[str, Any] | None) -> dict[str, Any] | None:
        with self._noted_lock:
            noted = self._noted.get(replica)
        if stats is None or (noted is not None and int(noted.get("at", 0)) > int(stats.get("at", 0))):
            return noted
        return dict(stats)

    def update_replicas(self, replicas: list[Any]) -> None:
        """Ray Serve's hook: the running replicas changed."""
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self.ranker.forget(live)
        with self._noted_lock:
            for name in [n for n in self._noted if n not in live]:
                del self._noted[name]

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[Any]:
        """Ray Serve's hook: the candidates ranked by :meth:`AffinityRanker.rank` on each one's newest
        report, one per rank."""
        hint = _hint_of(pending_request)
        rows = [
            (r.replica_id.unique_id, self._newest(r.replica_id.unique_id, r.routing_stats or None) or {})
            for r in candidate_replicas
        ]
        request_id = None
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            # Every replica is ranked each time: when none of them takes the request, Ray Serve should
            # wait before asking again rather than spin.
            pending_request.routing_context.should_backoff = True
        return [[candidate_replicas[i]] for i in self.ranker.rank(hint, rows, request_id)]

    def on_send_request(self, replica_id: Any) -> None:
        """Ray Serve's hook: a request went to ``replica_id``."""
        super().on_send_request(replica_id)
        self.ranker.sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        """Ray Serve's hook: a request on ``replica_id`` ended."""
        self.ranker.completed(replica_id.unique_id)
