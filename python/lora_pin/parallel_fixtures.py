"""Megatron-style parallel linears, registered with lora_pin, and a Hugging Face Llama cut over them.

These are what a serving framework's own layers look like (vLLM's and SGLang's ``ColumnParallelLinear``,
``RowParallelLinear``, ``QKVParallelLinear`` ...), kept minimal: the tests, ``lora-pin demo --tp`` and the
tensor-parallel benchmark run a tiny Llama sharded with :func:`shard_llama` on CPU over gloo. They are also
the worked example of :func:`~lora_pin.parallel.register_parallel_linear`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lora_pin.parallel import (
    ColumnSlice,
    ParallelLayout,
    TensorParallel,
    qkv_slices,
    register_parallel_linear,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_llama"]


class ColumnParallelLinear(torch.nn.Module):
    """``y_local = x @ W_localᵀ``: this rank's output rows of a (possibly fused) linear layer.

    Args:
        weight: the unsharded weight ``[sum of full_out, full_in]``, slices stacked in ``slices``' order.
        layout: a column :class:`ParallelLayout`; this rank keeps each slice's rows.
    """

    def __init__(self, weight: torch.Tensor, layout: ParallelLayout) -> None:
        super().__init__()
        parts, start = [], 0
        for s in layout.slices:
            begin, end = s.rows
            parts.append(weight[start + begin : start + end])
            start += s.full_out
        self.weight = torch.nn.Parameter(torch.cat(parts).clone(), requires_grad=False)
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., full_in] -> [..., local_out]``."""
        return F.linear(x, self.weight)


class RowParallelLinear(torch.nn.Module):
    """``y = all_reduce(x_local @ W_localᵀ)``: the layer's input columns cut over the ranks.

    Args:
        weight: the unsharded weight ``[full_out, full_in]``.
        tp: the group; this rank keeps input columns ``[rank * in/tp, (rank + 1) * in/tp)``.
    """

    def __init__(self, weight: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        full_out, full_in = weight.shape
        self.layout = ParallelLayout.row(tp, full_in, full_out)
        width = full_in // tp.size
        self.weight = torch.nn.Parameter(
            weight[:, tp.rank * width : (tp.rank + 1) * width].clone(), requires_grad=False
        )

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in/tp] -> [..., out]``, this rank's term of the sum."""
        return F.linear(x, self.weight)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place."""
        if self.layout.tp.size > 1:
            dist.all_reduce(partial, group=self.layout.tp.group)
        return partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in/tp] -> [..., out]``."""
        return self.reduce(self.partial(x))


register_parallel_linear(ColumnParallelLinear, layout=lambda m: m.layout)
register_parallel_linear(
    RowParallelLinear,
    layout=lambda m: m.layout,
    partial=lambda m, x: m.partial(x),
    reduce=lambda m, p: m.reduce(p),
)


def _column(
    linear: torch.nn.Linear, tp: TensorParallel, slices: Sequence[ColumnSlice]
) -> ColumnParallelLinear:
    weight = linear.weight.detach()
    return ColumnParallelLinear(weight, ParallelLayout("column", tp, weight.shape[1], tuple(slices)))


def shard_llama(model: torch.nn.Module, tp: TensorParallel) -> torch.nn.Module:
    """Cut a Hugging Face ``LlamaForCausalLM`` (no biases) over ``tp`` in place and return it: q/k/v and
    gate/up become :class:`ColumnParallelLinear`, o/down :class:`RowParallelLinear`; embeddings and
    ``lm_head`` stay whole. With fewer kv heads than ranks each kv head is replicated on
    ``tp.size // num_kv_heads`` ranks.

    Raises:
        SpecError: the heads or widths do not divide over the ranks.
    """
    llama: Any = model
    config = llama.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for layer in llama.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, _ = qkv_slices(
            tp, q_out=attn.q_proj.out_features, kv_out=attn.k_proj.out_features, num_kv_heads=kv_heads
        )
        attn.q_proj = _column(attn.q_proj, tp, [q])
        attn.k_proj = _column(attn.k_proj, tp, [k])
        attn.v_proj = _column(attn.v_proj, tp, [k])
        attn.o_proj = RowParallelLinear(attn.o_proj.weight.detach(), tp)
        # The attention computes its local heads: q's heads over the kv heads this rank holds.
        attn.num_key_value_groups = (heads // tp.size) // max(kv_heads // tp.size, 1)
        for name in ("gate_proj", "up_proj"):
            linear = getattr(mlp, name)
            setattr(mlp, name, _column(linear, tp, [ColumnSlice(linear.out_features, tp.rank, tp.size)]))
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.detach(), tp)
    return model
