"""The replica routing rule through Python: ordering, spill, pins by load, errors, and home stability."""

from __future__ import annotations

import math

import pytest

from lora_pin.errors import SpecError
from lora_pin.routing import ReplicaStats, home_replicas, rank_replicas, replication_factor

NAMES = [f"replica-{i}" for i in range(5)]


def _stats(**overrides: tuple[str, int, int]) -> list[ReplicaStats]:
    rows = []
    for name in NAMES:
        holding, free, queue = overrides.get(name.replace("-", "_"), ("absent", 0, 0))
        rows.append(ReplicaStats(name, holding, free, queue, 4))  # type: ignore[arg-type]
    return rows


def test_device_beats_host_beats_home_beats_load() -> None:
    home = home_replicas("a", NAMES, 1)[0]
    others = [i for i in range(5) if i != home]
    stats = _stats()
    stats[others[0]] = ReplicaStats(NAMES[others[0]], "device", 0, 3, 4)
    stats[others[1]] = ReplicaStats(NAMES[others[1]], "host", 0, 2, 4)
    stats[home] = ReplicaStats(NAMES[home], "absent", 1, 1, 4)
    stats[others[2]] = ReplicaStats(NAMES[others[2]], "absent", 2, 0, 4)
    stats[others[3]] = ReplicaStats(NAMES[others[3]], "absent", 2, 1, 4)
    assert rank_replicas("a", stats) == [others[0], others[1], home, others[2], others[3]]


def test_full_replica_spills_and_pins_go_by_load() -> None:
    stats = _stats(replica_0=("device", 0, 4), replica_1=("absent", 1, 3), replica_2=("absent", 1, 1))
    order = rank_replicas("a", stats)
    assert order[-1] == 0
    assert rank_replicas("a", stats, pinned=True)[:3] == [3, 4, 2]
    assert rank_replicas(None, stats)[:3] == [3, 4, 2]


def test_bad_stats_name_the_replica() -> None:
    stats = _stats()
    with pytest.raises(SpecError, match=r"replica-1.*named twice"):
        rank_replicas("a", [stats[1], stats[1]])
    with pytest.raises(SpecError, match='replica "replica-0": holding "gpu"'):
        rank_replicas("a", [ReplicaStats("replica-0", "gpu", 0, 0, 4)])  # type: ignore[arg-type]
    with pytest.raises(SpecError, match='replica "replica-0": queue must be at least 0'):
        rank_replicas("a", [ReplicaStats("replica-0", "absent", 0, -1, 4)])
    with pytest.raises(SpecError, match="no replicas"):
        rank_replicas("a", [])
    with pytest.raises(SpecError, match="share"):
        replication_factor(1.5, 4)


def test_replication_factor_is_share_times_replicas_rounded_up() -> None:
    for share in (0.0, 0.05, 0.25, 0.26, 0.6, 1.0):
        assert replication_factor(share, 8) == min(8, max(1, math.ceil(share * 8)))


def test_adding_a_replica_moves_only_the_homes_it_joins() -> None:
    adapters = [f"adapter-{i}" for i in range(3000)]
    before = [home_replicas(a, NAMES, 1)[0] for a in adapters]
    after = [home_replicas(a, [*NAMES, "replica-5"], 1)[0] for a in adapters]
    moved = [a != b for a, b in zip(before, after, strict=True)]
    assert all(b == 5 for b, m in zip(after, moved, strict=True) if m)
    assert abs(sum(moved) / len(adapters) - 1 / 6) < 0.03
