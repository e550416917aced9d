"""Ranks agree on what they read, not only that they read it.

Each tensor-parallel rank reads its own part of an adapter from its own view of the files. If the files
change between the ranks' reads (a new version renamed into place) or differ between nodes, every rank can
succeed and still hold parts of two different adapters: of different sizes, their registries and plans part
and the collectives abort the group; of the same size, outputs silently mix two versions. So after the ranks
agree that every read succeeded (:func:`~lora_pin.parallel.collective.agreed`), they compare what they
read: each rank hashes the whole of every tensor it streams past (not only its shard), so every rank knows
the whole adapter's digest, and one all-reduce of ``tp.size * 5`` int64 (each rank's 32-byte digest and the
whole adapter's bytes in its own row) shows every rank what every other read.

Cost (``benches/tp_loading.py``): each rank reads and hashes the whole adapter instead of its shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lora_pin.errors import AdapterLoadError
from lora_pin.parallel.collective import CollectiveLog
from lora_pin.parallel.sharding import TensorParallel

__all__ = ["agree_identity"]

_WORDS = 4  # int64 words of a 32-byte digest


def agree_identity(
    tp: TensorParallel, what: str, digest: str, whole_bytes: int, log: CollectiveLog | None = None
) -> None:
    """Compare this rank's ``digest`` (64 hex characters) and ``whole_bytes`` with every rank's.

    Must be called by every rank of ``tp.group``, in the same order.

    Raises:
        AdapterLoadError: on every rank, when any two ranks differ; the message names the ranks of each
            version read (``what`` names the operation). The caller then changes nothing.
    """
    raw = bytes.fromhex(digest)
    row = [int.from_bytes(raw[i * 8 : (i + 1) * 8], "little", signed=True) for i in range(_WORDS)]
    status = torch.zeros(tp.size, _WORDS + 1, dtype=torch.int64)
    status[tp.rank] = torch.tensor([*row, whole_bytes], dtype=torch.int64)
    if log is not None:
        log.add("agree_identity", status)
    dist.all_reduce(status, group=tp.group)
    rows = [tuple(r) for r in status.tolist()]
    if len(set(rows)) == 1:
        return
    versions: dict[tuple[int, ...], list[int]] = {}
    for rank, seen in enumerate(rows):
        versions.setdefault(seen, []).append(rank)
    described = "; ".join(
        f"rank(s) {ranks} read digest {_hex(seen[:_WORDS])} ({seen[_WORDS]} bytes)"
        for seen, ranks in versions.items()
    )
    raise AdapterLoadError(
        f"{what}: the tensor-parallel ranks read different adapters ({described}); refused on every rank, "
        "nothing changed. The files changed between the ranks' reads, or differ between the nodes: make "
        "them identical and load again"
    )


def _hex(words: tuple[int, ...]) -> str:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words).hex()
