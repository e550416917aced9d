"""The checks of an adapter against the model, run before any host tensor is built: every tensor fits a
target it serves (shape, rank, the config's ``r``/``rank_pattern``), every target the config names has
tensors, no tensor goes unused, and a DoRA adapter's magnitudes are there and fit. Each refusal names the
adapter, the file and the field, module or tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lora_pin.errors import AdapterLoadError
from lora_pin.weights.reader import PEFT_PREFIX, AdapterFile, LoraTensorPair
from lora_pin.weights.shards import GroupCut, ShardPlan
from lora_pin.weights.targets import LinearTarget, LoRATargets

_LISTED = 8


def _listing(names: Iterable[str]) -> str:
    items = sorted(names)
    shown = ", ".join(repr(n) for n in items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def _expert_pairs(file: AdapterFile, targets: LoRATargets) -> dict[str, LoraTensorPair]:
    """The tensor pair of every MoE expert weight the adapter's ``target_parameters`` name, by parameter key.

    PEFT wraps each targeted parameter of one experts module in a nested wrapper, the first in the
    module's parameter order innermost, and saves each wrapper's tensors under its own path: with
    ``gate_up_proj`` and ``down_proj`` targeted, ``...experts.base_layer.lora_A.weight`` is
    ``gate_up_proj``'s and ``...experts.lora_A.weight`` is ``down_proj``'s. The targets list an experts
    module's weights in that parameter order.

    Raises:
        AdapterLoadError: an entry names no expert weight this model serves (with the reason when the model
            has it but it is not served), or a named weight has no tensors.
    """
    config, where = file.config, f"adapter {file.name!r} ({file.config.file})"
    if not config.target_parameters:
        return {}
    served = [t for t in targets.linears if t.experts]
    for entry in config.target_parameters:
        if not any(t.key == entry or t.key.endswith(f".{entry}") for t in served):
            unserved = [k for k in targets.unserved if k == entry or k.endswith(f".{entry}")]
            raise AdapterLoadError(
                f"{where}: field 'target_parameters' names {entry!r}, "
                + (
                    _why_not_target(targets, unserved)
                    if unserved
                    else "which is not a MoE expert weight lora_pin serves in this model (served: "
                    f"{_listing(t.key for t in served) or 'none'})"
                )
            )
    if refused := [k for k in targets.unserved if config.targets_parameter(k)]:
        raise AdapterLoadError(
            f"{where}: field 'target_parameters' names expert weight " + _why_not_target(targets, refused)
        )
    by_module: dict[str, list[LinearTarget]] = {}
    for t in served:
        if config.targets_parameter(t.key):
            by_module.setdefault(t.key.rpartition(".")[0], []).append(t)
    found: dict[str, LoraTensorPair] = {}
    for module_key, members in by_module.items():
        for depth, target in enumerate(reversed(members)):
            stored_key = module_key + ".base_layer" * depth
            pair = file.pairs.get(stored_key)
            if pair is None:
                raise AdapterLoadError(
                    f"adapter {file.name!r} ({file.weights_path}): the config targets expert weight "
                    f"{target.key!r}, which has no tensors {PEFT_PREFIX}{stored_key}.lora_A.weight / "
                    "lora_B.weight"
                )
            found[target.key] = pair
    return found


def _check_expert_pair(file: AdapterFile, pair: LoraTensorPair, target: LinearTarget, max_rank: int) -> int:
    """The rank of an expert weight's pair: PEFT's A ``[r * E, in]`` and B ``[out, r * E]`` (A
    ``[r * E, out]`` and B ``[in, r * E]`` for a ``peft_swapped`` target)."""
    where = f"adapter {file.name!r} ({file.weights_path})"
    experts = target.experts
    stacked = pair.a_shape[0]
    a_width, b_height = target.in_features, target.out_features
    if target.peft_swapped:
        a_width, b_height = b_height, a_width
    if (
        pair.embedding
        or stacked % experts
        or pair.a_shape != (stacked, a_width)
        or pair.b_shape != (b_height, stacked)
    ):
        raise AdapterLoadError(
            f"{where}: tensors {pair.a_name!r} {list(pair.a_shape)} / {pair.b_name!r} {list(pair.b_shape)} "
            f"do not fit expert weight {target.key!r} ({experts} experts, in={target.in_features}, "
            f"out={target.out_features}): expected lora_A [r * {experts}, {a_width}] and "
            f"lora_B [{b_height}, r * {experts}]"
        )
    rank = stacked // experts
    configured = file.config.rank_for(target.key)
    if rank != configured:
        raise AdapterLoadError(
            f"{where}: tensor {pair.a_name!r} has rank {rank} per expert but field 'r'/'rank_pattern' "
            f"gives {configured} for expert weight {target.key!r}"
        )
    if rank > max_rank:
        raise AdapterLoadError(
            f"{where}: expert weight {target.key!r} has rank {rank}, above the pool's max rank {max_rank} "
            "(field 'r'/'rank_pattern')"
        )
    return rank


def _check_against_model(
    file: AdapterFile, targets: LoRATargets, max_rank: int, shards: ShardPlan[GroupCut]
) -> tuple[dict[str, int], dict[str, LoraTensorPair]]:
    """Validate the adapter's modules against the model; return the rank of each target key it touches
    and the tensor pair of each (keyed by module key, or by parameter key for an expert weight)."""
    name, config, where = file.name, file.config, f"adapter {file.name!r} ({file.weights_path})"
    expert_pairs = _expert_pairs(file, targets)
    if expert_pairs and shards.parallel:
        raise AdapterLoadError(
            f"{where}: field 'target_parameters' puts LoRA on MoE expert weights "
            f"({_listing(expert_pairs)}), which lora_pin does not serve under tensor parallelism; serve "
            "this adapter on an unsharded model, or train it without target_parameters"
        )
    stored_expert_keys = {p.module_key for p in expert_pairs.values()}
    known = [t.key for t in targets.linears if not t.experts]
    if isinstance(config.target_modules, tuple):
        for entry in sorted(config.target_modules):
            if not any(k == entry or k.endswith(f".{entry}") for k in known):
                raise AdapterLoadError(
                    f"adapter {name!r} ({config.file}): field 'target_modules' names {entry!r}, "
                    + _why_not_target(
                        targets, [k for k in targets.unserved if k == entry or k.endswith(f".{entry}")]
                    )
                )
    pairs = {k: p for k, p in file.pairs.items() if k not in stored_expert_keys}
    known_set = set(known)
    matched = [k for k in pairs if k in known_set]
    stray_modules = [k for k in pairs if k not in known_set]
    if explained := [k for k in stray_modules if k in targets.unserved]:
        raise AdapterLoadError(f"{where}: it has tensors for module " + _why_not_target(targets, explained))
    if not matched and not expert_pairs:
        raise AdapterLoadError(
            f"{where}: no tensor matches any LoRA target of this model (it would silently serve base-model "
            f"output); tensors found for modules {_listing(pairs) or 'none'}"
        )
    strays = [n for k in stray_modules for n in (pairs[k].a_name, pairs[k].b_name)]
    unused = [n for n in file.unused if not _is_base_copy(file, targets, n)]
    if unused or strays:
        raise AdapterLoadError(
            f"{where}: {len(unused) + len(strays)} tensor(s) would be unused: {_listing(unused + strays)}"
        )
    expected = {k for k in known if config.targets(k)}
    if missing := expected - pairs.keys():
        raise AdapterLoadError(
            f"{where}: the config targets modules with no lora_A/lora_B tensors: {_listing(missing)}"
        )
    if extra := pairs.keys() - expected:
        raise AdapterLoadError(
            f"{where}: tensors for modules the config's target_modules/layers_to_transform exclude: "
            f"{_listing(extra)}"
        )
    # PEFT ignores a key that matches nothing; it is a typo that silently serves the default r/alpha.
    for field_name, pattern_key in config.unused_pattern_keys([*expected, *expert_pairs]):
        raise AdapterLoadError(
            f"adapter {name!r} ({config.file}): field {field_name!r} key {pattern_key!r} matches no "
            f"module the adapter targets ({_listing([*expected, *expert_pairs])})"
        )
    ranks: dict[str, int] = {}
    for key in matched:
        pair, target = pairs[key], targets.linear(key)
        assert target is not None
        ranks[key] = _check_pair(file, pair, target, max_rank, shards)
    for key, pair in expert_pairs.items():
        target = targets.linear(key)
        assert target is not None
        ranks[key] = _check_expert_pair(file, pair, target, max_rank)
    _check_dora(file, targets, {k: pairs[k] for k in matched}, shards)
    return ranks, {k: pairs[k] for k in matched} | expert_pairs


def _check_dora(
    file: AdapterFile, targets: LoRATargets, pairs: dict[str, LoraTensorPair], shards: ShardPlan[GroupCut]
) -> None:
    """A DoRA adapter (``use_dora``) has one ``lora_magnitude_vector`` ``[out]`` per targeted linear; a
    plain one has none. DoRA on an embedding (PEFT scales its lookup differently) is refused by name.

    Raises:
        AdapterLoadError: naming the adapter, the file and the module or tensor.
    """
    where = f"adapter {file.name!r} ({file.weights_path})"
    if not file.config.use_dora:
        if magnitudes := [p.magnitude_name for p in pairs.values() if p.magnitude_name is not None]:
            raise AdapterLoadError(
                f"{where}: tensor(s) {_listing(magnitudes)} are DoRA magnitudes, but the config's field "
                "'use_dora' is not true (a DoRA adapter with a wrong config, or a plain one with stray "
                "tensors)"
            )
        return
    if shards.fully_sharded:
        raise AdapterLoadError(
            f"{where}: field 'use_dora' is true; lora_pin does not serve DoRA adapters with fully sharded "
            "tensor parallelism (a rank holds only a chunk of A's or B's rank, and a DoRA norm needs the "
            "whole product B A of its rows); serve it with TensorParallel(fully_sharded=False)"
        )
    for key, pair in pairs.items():
        if pair.embedding:
            raise AdapterLoadError(
                f"{where}: DoRA on embedding {key!r} cannot be served (field 'use_dora' is true and it "
                "targets an embedding; lora_pin serves DoRA on linear layers only)"
            )
        target = targets.linear(key)
        assert target is not None
        if pair.magnitude_name is None:
            raise AdapterLoadError(
                f"{where}: field 'use_dora' is true (DoRA) but module {key!r} has no tensor "
                f"{PEFT_PREFIX}{key}.lora_magnitude_vector"
            )
        out_features = shards.member(target).full_out
        if pair.magnitude_shape != (out_features,):
            raise AdapterLoadError(
                f"{where}: tensor {pair.magnitude_name!r} has shape {list(pair.magnitude_shape or ())}, "
                f"expected [{out_features}] (one magnitude per output feature of module {key!r})"
            )


def _is_base_copy(file: AdapterFile, targets: LoRATargets, tensor_name: str) -> bool:
    """Whether ``tensor_name`` is PEFT's copy of a targeted embedding's or output layer's base weight
    (``<module>.base_layer.weight``, saved when ``target_modules`` names one) equal to the model's.

    Raises:
        AdapterLoadError: it is such a copy, but its shape or values (in the model's dtype) differ from the
            model's weight: a resized or retrained layer, whose adapter the model's weight cannot serve.
    """
    module_key = tensor_name.removeprefix(PEFT_PREFIX).removesuffix(".base_layer.weight")
    weight = targets.base_weights.get(module_key)
    if weight is None or tensor_name != f"{PEFT_PREFIX}{module_key}.base_layer.weight":
        return False
    stored = file.tensor(tensor_name)
    if tuple(stored.shape) != tuple(weight.shape) or not torch.equal(
        stored.to(device=weight.device, dtype=weight.dtype), weight.detach()
    ):
        raise AdapterLoadError(
            f"adapter {file.name!r} ({file.weights_path}): tensor {tensor_name!r} {list(stored.shape)}, "
            f"PEFT's copy of module {module_key!r}'s base weight, differs from the model's "
            f"{list(weight.shape)} (a resized or retrained layer is not served)"
        )
    return True


def _why_not_target(targets: LoRATargets, unserved: list[str]) -> str:
    """Why the module(s) ``unserved`` (keys of the model that are no targets, maybe none) cannot be served."""
    if not unserved:
        return (
            "which is not a LoRA target of this model: no linear layer it wraps has that name (targets: "
            f"{', '.join(targets.module_names)})"
        )
    more = f" (and {len(unserved) - 1} more)" if len(unserved) > 1 else ""
    return f"{unserved[0]!r}{more}, which is not served: {targets.unserved[unserved[0]]}"


def _check_pair(
    file: AdapterFile, pair: LoraTensorPair, target: LinearTarget, max_rank: int, shards: ShardPlan[GroupCut]
) -> int:
    where = f"adapter {file.name!r} ({file.weights_path})"
    # A tensor-parallel rank's module is a shard of the layer the adapter was trained on: the stored tensors
    # have the unsharded widths, of which this rank reads its part.
    shard = shards.member(target)
    in_features, out_features = shard.full_in, shard.full_out
    if pair.embedding != target.embedding:
        held, actual, expected = (
            ("an embedding's", "a linear layer", "lora_A/lora_B")
            if pair.embedding
            else ("a linear layer's", "an embedding", "lora_embedding_A/lora_embedding_B")
        )
        raise AdapterLoadError(
            f"{where}: tensors {pair.a_name!r} / {pair.b_name!r} are {held}, but module {target.key!r} "
            f"is {actual} (expected {expected})"
        )
    rank = pair.a_shape[0]
    if pair.a_shape != (rank, in_features) or pair.b_shape != (out_features, rank):
        raise AdapterLoadError(
            f"{where}: tensors {pair.a_name!r} {list(pair.a_shape)} / {pair.b_name!r} {list(pair.b_shape)} "
            f"do not fit module {target.key!r} (in={in_features}, out={out_features}): "
            f"expected [r, {in_features}] and [{out_features}, r]"
        )
    configured = file.config.rank_for(target.key)
    if rank != configured:
        raise AdapterLoadError(
            f"{where}: tensor {pair.a_name!r} has rank {rank} but field 'r'/'rank_pattern' gives "
            f"{configured} for module {target.key!r}"
        )
    if rank > max_rank:
        raise AdapterLoadError(
            f"{where}: module {target.key!r} has rank {rank}, above the pool's max rank {max_rank} "
            "(field 'r'/'rank_pattern')"
        )
    return rank
