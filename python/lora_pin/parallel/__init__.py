"""Tensor parallelism: adapters sharded over ``torch.distributed``, outputs equal to one process's.

- :mod:`~lora_pin.parallel.sharding`: the rules, which part of each adapter a rank holds, per layer kind
  (column, row) and mode (``fully_sharded`` or not);
- :mod:`~lora_pin.parallel.layers`: the sharded forward around a framework's parallel layer;
- :mod:`~lora_pin.parallel.api`: :func:`register_parallel_linear`, how a framework declares its layers;
- :mod:`~lora_pin.parallel.collective`: one small all-reduce that makes every load all-or-nothing over
  the ranks;
- :mod:`~lora_pin.parallel.tiny`: Megatron-style parallel layers and a sharded tiny Llama (tests, demo).

A manager built with ``tp=TensorParallel(rank, size, group)`` on every rank serves the adapters with each
rank reading, holding and computing only its shard.
"""

from lora_pin.parallel.api import ParallelKind, parallel_kind, register_parallel_linear, shard_plan
from lora_pin.parallel.collective import agree
from lora_pin.parallel.layers import CollectiveLog, ParallelLoRALinear, RowCall
from lora_pin.parallel.sharding import (
    ColumnSlice,
    GroupShard,
    MemberShard,
    ParallelLayout,
    ShardPlan,
    TensorParallel,
    qkv_slices,
)

__all__ = [
    "CollectiveLog",
    "ColumnSlice",
    "GroupShard",
    "MemberShard",
    "ParallelKind",
    "ParallelLayout",
    "ParallelLoRALinear",
    "RowCall",
    "ShardPlan",
    "TensorParallel",
    "agree",
    "parallel_kind",
    "qkv_slices",
    "register_parallel_linear",
    "shard_plan",
]
