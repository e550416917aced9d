"""The way in for a framework's own parallel layers: teach lora_pin how each class is cut and called.

A framework registers each of its parallel linear classes once (:func:`register_parallel_linear`), saying
for a layer how it is cut (:class:`~lora_pin.parallel.sharding.ParallelLayout`: column or row, the
unsharded widths, the tensor-parallel rank and group) and, for a row-parallel class, how to run it in two
halves (:class:`RowCall`). A :class:`~lora_pin.LoRAManager` built with ``tp=TensorParallel(...)`` then
wraps those layers with :class:`~lora_pin.model.parallel_layers.ParallelLoRALinear`, reads and keeps only
this rank's part of each adapter, and makes every load, unload, pin and unpin collective
(:class:`~lora_pin.parallel.group.TensorParallelGroup`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lora_pin.errors import SpecError
from lora_pin.parallel.group import Collective, SingleProcess, TensorParallelGroup
from lora_pin.parallel.sharding import GroupShard, ParallelLayout, TensorParallel, group_shard
from lora_pin.weights.shards import WHOLE, ShardPlan
from lora_pin.weights.targets import LoRATargets, TargetGroup, output_layer_keys, register_linear

__all__ = [
    "ParallelKind",
    "RowCall",
    "detect_tp",
    "dtensor_cut",
    "dtensor_tp",
    "manager_shard_plan",
    "parallel_kind",
    "register_parallel_linear",
    "shard_plan",
]


@dataclass(frozen=True)
class RowCall:
    """How to run a row-parallel layer in two halves, so the delta joins the partial sum before the reduce.

    Attributes:
        partial: ``(layer, x [..., in/tp]) -> [..., out]``, this rank's partial product: no all-reduce,
            no bias.
        reduce: ``(layer, partial [..., out]) -> result``, what the layer's forward does after its product
            (all-reduce over the group, the bias), returning what its forward returns (a tensor or
            ``(out, bias)``).
    """

    partial: Callable[[Any, torch.Tensor], torch.Tensor]
    reduce: Callable[[Any, torch.Tensor], Any]


@dataclass(frozen=True)
class ParallelKind:
    """How lora_pin treats one parallel linear class (see :func:`register_parallel_linear`)."""

    layout: Callable[[torch.nn.Module], ParallelLayout]
    returns_bias: bool
    row_call: RowCall | None


_PARALLEL: dict[type[torch.nn.Module], ParallelKind] = {}


def register_parallel_linear(
    cls: type[torch.nn.Module],
    *,
    layout: Callable[[Any], ParallelLayout],
    returns_bias: bool = False,
    partial: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    reduce: Callable[[Any, torch.Tensor], Any] | None = None,
) -> None:
    """Teach lora_pin a framework's tensor-parallel linear class (a ``ColumnParallelLinear``,
    ``QKVParallelLinear``, ``RowParallelLinear`` ...); also registers it as a linear
    (:func:`lora_pin.register_linear`) with its local widths.

    Args:
        cls: the layer class.
        layout: ``layer -> ParallelLayout``, how that layer is cut: its kind, unsharded widths, output
            slices (a fused qkv's three, each with its own shard index under GQA:
            :func:`~lora_pin.parallel.qkv_slices`) and the :class:`~lora_pin.parallel.TensorParallel` it
            is cut over.
        returns_bias: the layer's forward returns ``(out, bias)``; the delta is added to ``out``.
        partial: row-parallel only, ``(layer, x [..., in/tp]) -> [..., out]``: the layer's partial product,
            before its all-reduce and bias.
        reduce: row-parallel only, ``(layer, partial) -> result``: the rest of the layer's forward (the
            all-reduce over its group, the bias), returning what the forward returns.

    Raises:
        SpecError: ``cls`` is not an ``nn.Module`` subclass, ``layout`` is not callable, or only one of
            ``partial`` and ``reduce`` is given.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise SpecError(f"register_parallel_linear: {cls!r} is not a torch.nn.Module subclass")
    if not callable(layout):
        raise SpecError(f"register_parallel_linear: layout must be callable, got {type(layout).__name__}")
    if (partial is None) != (reduce is None):
        raise SpecError("register_parallel_linear: give both partial and reduce (row-parallel) or neither")
    row_call = None if partial is None or reduce is None else RowCall(partial, reduce)

    def features(module: torch.nn.Module) -> tuple[int, int]:
        """The layer's local widths, ``(in, out)`` on this rank."""
        shape = layout(module)
        return shape.local_in, shape.local_out

    register_linear(cls, features=features, returns_bias=returns_bias)
    _PARALLEL[cls] = ParallelKind(layout, bool(returns_bias), row_call)


def parallel_kind(module: torch.nn.Module) -> ParallelKind | None:
    """The registered :class:`ParallelKind` of ``module``'s class (or a parent class whose forward it
    keeps); for an ``nn.Linear`` whose weight is a ``DTensor`` cut on one dimension (transformers'
    ``tp_plan`` styles ``colwise`` and ``rowwise``), the kind its placement says; None for a layer that
    is not cut."""
    base = getattr(module, "base_layer", None)
    if isinstance(base, torch.nn.Module):
        module = base
    cls: type[torch.nn.Module] = type(module)
    for parent in cls.__mro__:
        kind = _PARALLEL.get(parent)
        if kind is not None:
            return kind if parent is cls or cls.forward is getattr(parent, "forward", None) else None
    if isinstance(module, torch.nn.Linear) and dtensor_cut(module) is not None:
        return _DTENSOR_COLUMN if dtensor_cut(module) == 0 else _DTENSOR_ROW
    return None


def dtensor_cut(module: torch.nn.Module) -> int | None:
    """The dimension of the weight ``[out, in]`` a ``DTensor``-sharded linear is cut on over a one-dimensional
    device mesh (0: column, 1: row), or None when its weight is no such ``DTensor``."""
    from torch.distributed.tensor import DTensor, Shard

    weight = getattr(module, "weight", None)
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or len(weight.placements) != 1:
        return None
    placement = weight.placements[0]
    if not isinstance(placement, Shard):
        return None
    return placement.dim % 2


def dtensor_tp(module: torch.nn.Module, fully_sharded: bool = False) -> TensorParallel:
    """The :class:`TensorParallel` of a ``DTensor``-sharded linear: its device mesh's rank, size and group."""
    weight: Any = module.weight
    mesh = weight.device_mesh
    return TensorParallel(mesh.get_local_rank(), mesh.size(), mesh.get_group(), fully_sharded)


def _dtensor_layout(module: Any) -> ParallelLayout:
    tp = dtensor_tp(module)
    if dtensor_cut(module) == 0:
        return ParallelLayout.column(tp, module.in_features, module.out_features)
    return ParallelLayout.row(tp, module.in_features, module.out_features)


def _dtensor_partial(module: Any, x: torch.Tensor) -> torch.Tensor:
    # What transformers' rowwise inference path computes before its all-reduce: the local product, no bias.
    return torch.nn.functional.linear(x, module.weight.to_local())


def _dtensor_reduce(module: Any, partial: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(partial, group=module.weight.device_mesh.get_group())
    bias = module._parameters.get("bias")
    if bias is None:
        return partial
    return partial + (bias.to_local() if hasattr(bias, "to_local") else bias)


_DTENSOR_COLUMN = ParallelKind(_dtensor_layout, False, None)
_DTENSOR_ROW = ParallelKind(_dtensor_layout, False, RowCall(_dtensor_partial, _dtensor_reduce))


def detect_tp(model: torch.nn.Module, module_keys: Iterable[str]) -> TensorParallel | None:
    """The tensor parallelism of a model cut by transformers' ``tp_plan`` (``DTensor`` weights): that of the
    first of ``module_keys`` whose weight is a cut ``DTensor``, or None when none is."""
    for key in module_keys:
        module = model.get_submodule(key)
        if isinstance(module, torch.nn.Linear) and dtensor_cut(module) is not None:
            return dtensor_tp(module)
    return None


def shard_plan(
    model: torch.nn.Module,
    targets: LoRATargets,
    module_of: Mapping[str, str],
    tp: TensorParallel,
    max_rank: int | None = None,
) -> ShardPlan[GroupShard]:
    """This rank's sharding of every target group whose layer is a registered parallel class; other
    targets (an embedding, an ``lm_head`` kept whole) are replicated and served as on one process.
    ``max_rank`` (the pool's) fixes each rank's chunk of the rank dimension when ``tp.fully_sharded``.

    Raises:
        SpecError: a layer's layout is cut over another rank or size than ``tp``, a row-parallel class was
            registered without ``partial``/``reduce``, or a layout does not match the layer's targets;
            ``tp.fully_sharded`` without ``max_rank``.
    """
    groups: dict[str, tuple[TargetGroup, GroupShard]] = {}
    output = output_layer_keys(model)
    for group in targets.groups:
        key = module_of[group.key]
        module = model.get_submodule(key)
        kind = parallel_kind(module)
        weight = getattr(getattr(module, "base_layer", module), "weight", None)
        if type(weight).__name__ == "DTensor" and (kind is None or key in output):
            # transformers cuts its embeddings by vocabulary rows and gathers lm_head's output: neither is
            # a column or row layer whose delta lands in this rank's output.
            raise SpecError(
                f"{key!r} is cut by tensor parallelism ({type(module).__name__}, output layer or embedding) "
                "in a way lora_pin does not serve sharded; leave it out of lora_target_modules"
            )
        if kind is None:
            continue
        base = getattr(module, "base_layer", module)
        layout = kind.layout(base)
        if (layout.tp.rank, layout.tp.size) != (tp.rank, tp.size):
            raise SpecError(
                f"{key!r} is cut as rank {layout.tp.rank} of {layout.tp.size} but the manager's tp is rank "
                f"{tp.rank} of {tp.size}"
            )
        if layout.kind == "row" and kind.row_call is None:
            raise SpecError(
                f"{key!r} ({type(base).__name__}) is row-parallel: register it with partial= and reduce= so "
                "the delta joins the partial sum before its all-reduce"
            )
        groups[group.key] = (group, group_shard(layout, group, tp.fully_sharded))
    return ShardPlan(groups, parallel=True, ranks=tp.size, fully_sharded=tp.fully_sharded, max_rank=max_rank)


def manager_shard_plan(
    model: torch.nn.Module,
    targets: LoRATargets,
    module_of: Mapping[str, str],
    tp: TensorParallel | None,
    max_rank: int | None,
) -> tuple[ShardPlan[GroupShard], Collective]:
    """A manager's shard plan and :class:`~lora_pin.parallel.group.Collective`: for ``tp``, or for the
    tensor parallelism of a model cut by transformers' ``tp_plan`` (``DTensor`` weights) when ``tp`` is
    None; ``(WHOLE, SingleProcess())`` for a model on one process.

    Raises:
        SpecError: as :func:`shard_plan`; or ``fully_sharded`` without ``max_rank`` (each rank's chunk of the
            rank dimension is cut from the pool's rank, fixed before any read).
    """
    if tp is None and any(type(p).__name__ == "DTensor" for p in model.parameters()):
        # A model cut by transformers' tp_plan: its linears' device mesh says where this process stands.
        tp = detect_tp(model, module_of.values())
    if tp is None:
        return WHOLE, SingleProcess()
    if tp.fully_sharded and max_rank is None:
        raise SpecError(
            "tp=TensorParallel(fully_sharded=True) needs max_lora_rank: each rank holds a chunk of the "
            "pool's rank, fixed before any adapter is read"
        )
    return shard_plan(model, targets, module_of, tp, max_rank), TensorParallelGroup(tp)
