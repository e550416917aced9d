"""Tensor parallelism: adapters sharded over ``torch.distributed``, outputs equal to one process's.

A layer below the model: it knows how adapters are cut and how ranks agree, not what a manager or a LoRA
layer is.

- :mod:`~lora_pin.parallel.sharding`: the rules, which part of each adapter a rank holds, per layer kind
  (column, row) and mode (``fully_sharded`` or not);
- :mod:`~lora_pin.parallel.api`: :func:`register_parallel_linear`, how a framework declares its layers;
- :mod:`~lora_pin.parallel.collective`: one small all-reduce that makes every load all-or-nothing over
  the ranks, and :class:`CollectiveLog`, which counts them;
- :mod:`~lora_pin.parallel.group`: the :class:`Collective` a manager calls for every state change, which
  does nothing on one process (:class:`SingleProcess`) and agrees over the ranks otherwise
  (:class:`TensorParallelGroup`).

The sharded forward is :class:`lora_pin.model.parallel_layers.ParallelLoRALinear`; Megatron-style layers
and a sharded tiny Llama for tests and the demo are in :mod:`lora_pin.parallel_fixtures`.

A manager built with ``tp=TensorParallel(rank, size, group)`` on every rank serves the adapters with each
rank reading, holding and computing only its shard.
"""

from lora_pin.parallel.api import ParallelKind, RowCall, parallel_kind, register_parallel_linear, shard_plan
from lora_pin.parallel.collective import CollectiveLog, agree
from lora_pin.parallel.group import Collective, SingleProcess, TensorParallelGroup
from lora_pin.parallel.sharding import ColumnSlice, GroupShard, ParallelLayout, TensorParallel, qkv_slices
from lora_pin.weights.shards import MemberShard, ShardPlan

__all__ = [
    "Collective",
    "CollectiveLog",
    "ColumnSlice",
    "GroupShard",
    "MemberShard",
    "ParallelKind",
    "ParallelLayout",
    "RowCall",
    "ShardPlan",
    "SingleProcess",
    "TensorParallel",
    "TensorParallelGroup",
    "agree",
    "parallel_kind",
    "qkv_slices",
    "register_parallel_linear",
    "shard_plan",
]
