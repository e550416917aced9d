"""``lora-pin inspect PATH``: what an adapter holds, or the precise reason it cannot be served."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from lora_pin.cli._model_dir import local_model_dir
from lora_pin.errors import AdapterLoadError, SpecError

if TYPE_CHECKING:
    import torch

    from lora_pin.weights.reader import AdapterFile, LoraTensorPair
    from lora_pin.weights.targets import LoRATargets

__all__ = ["add_parser", "run"]

# Serving dtypes by their torch attribute name; torch itself loads only when the command runs.
_DTYPES = ("bfloat16", "float16", "float32")


def add_parser(subparsers: Any) -> None:
    """Registers ``inspect`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "inspect",
        help="show an adapter's ranks, alpha, scaling, targets and size, or why it cannot be served",
        description=(
            "Read a PEFT LoRA adapter directory and print its rank(s), alpha, scaling, target modules, layer "
            "count, dtype, bytes and content digest (what a manager's identity(name).digest will be). With "
            "--model, also validate it against that model's layers. Exit 2 with the reason when it cannot be "
            "served."
        ),
    )
    p.add_argument("path", metavar="PATH", help="the adapter directory (adapter_config.json + weights)")
    p.add_argument("--model", metavar="DIR", help="a Hugging Face model directory to validate against")
    p.add_argument("--max-rank", type=int, default=None, help="the pool's max rank (default: no limit)")
    p.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="serving dtype for device bytes (default: the model's with --model, else bfloat16)",
    )
    p.add_argument("--allow-pickle", action="store_true", help="read adapter_model.bin (weights_only=True)")
    p.add_argument(
        "--allowed-root", action="append", metavar="DIR", help="refuse paths outside DIR (repeatable)"
    )
    p.set_defaults(run=run)


def _base_copies(file: AdapterFile) -> dict[str, str]:
    """PEFT's copies of the base weights of the modules the adapter has a pair for, by module key: PEFT saves
    ``<module>.base_layer.weight`` beside LoRA on ``lm_head`` or an embedding, and a manager serving the
    adapter checks it against the model's weight (so does ``--model``)."""
    from lora_pin.weights.reader import PEFT_PREFIX

    copies = {}
    for tensor_name in file.unused:
        key = tensor_name.removeprefix(PEFT_PREFIX).removesuffix(".base_layer.weight")
        if tensor_name == f"{PEFT_PREFIX}{key}.base_layer.weight" and key in file.pairs:
            copies[key] = tensor_name
    return copies


def _check_standalone(file: AdapterFile) -> None:
    where = f"adapter {file.name!r} ({file.weights_path})"
    if not file.pairs:
        raise AdapterLoadError(
            f"{where}: no lora_A/lora_B tensor pair; it would silently serve base-model output"
        )
    copies = set(_base_copies(file).values())
    if unused := [n for n in file.unused if n not in copies]:
        raise AdapterLoadError(f"{where}: {len(unused)} tensor(s) would be unused: {unused[:8]}")
    experts = _expert_pair_keys(file)
    for key, pair in file.pairs.items():
        rank = pair.a_shape[0]
        if key in experts:
            # A MoE expert weight's pair stacks every expert's rank (A [r * E, in], B [out, r * E]); E and
            # so r are known only from the model (--model checks them).
            if pair.b_shape[1] != rank:
                raise AdapterLoadError(
                    f"{where}: expert weights {key!r} have lora_A {list(pair.a_shape)} / lora_B "
                    f"{list(pair.b_shape)}: lora_A's rows must equal lora_B's columns (r * experts)"
                )
            continue
        if pair.b_shape[1] != rank or rank != file.config.rank_for(key):
            raise AdapterLoadError(
                f"{where}: module {key!r} has lora_A {list(pair.a_shape)} / lora_B {list(pair.b_shape)}, but "
                f"field 'r'/'rank_pattern' gives rank {file.config.rank_for(key)}"
            )
        _check_magnitude(file, key, pair)


def _check_magnitude(file: AdapterFile, key: str, pair: LoraTensorPair) -> None:
    """A DoRA adapter has a ``lora_magnitude_vector`` ``[out]`` beside each linear pair; a plain one none
    (what a load checks against the model, see :mod:`lora_pin.weights.host_tier`)."""
    where = f"adapter {file.name!r} ({file.weights_path})"
    if not file.config.use_dora:
        if pair.magnitude_name is not None:
            raise AdapterLoadError(
                f"{where}: tensor {pair.magnitude_name!r} is a DoRA magnitude, but field 'use_dora' is "
                "not true"
            )
        return
    if pair.embedding:
        raise AdapterLoadError(f"{where}: DoRA on embedding {key!r} cannot be served (linear layers only)")
    if pair.magnitude_name is None or pair.magnitude_shape != (pair.b_shape[0],):
        raise AdapterLoadError(
            f"{where}: field 'use_dora' is true (DoRA) but module {key!r} has no tensor "
            f"{key}.lora_magnitude_vector of shape [{pair.b_shape[0]}]"
        )


def _expert_pair_keys(file: AdapterFile) -> set[str]:
    """The module keys of the adapter's pairs that hold MoE expert weights (``target_parameters``): those
    its ``target_modules`` do not target."""
    if not file.config.target_parameters:
        return set()
    return {k for k in file.pairs if not file.config.targets(k)}


def _model_targets(model_dir: str, file: AdapterFile) -> tuple[LoRATargets, torch.dtype]:
    """The targets a manager serving ``file`` would wrap in the model at ``model_dir`` (every linear layer
    and MoE expert weight, and the output layer and embeddings the adapter names), and the model's dtype.
    The model is built on the meta device: no weights are read but the base weights whose copies the
    adapter holds (:func:`_base_copies`), which are checked against them as a manager checks them.

    Raises:
        SpecError: no model config or model can be read from ``model_dir``.
    """
    import torch
    import transformers

    from lora_pin.weights.targets import LoRATargets

    model_dir = local_model_dir(model_dir)
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise SpecError(f"--model: cannot read a model config from {model_dir!r}: {e}") from e
    dtype = _config_dtype(config)
    errors = []
    # The classes adapters are trained on, most common first: the key layout PEFT saves depends on it.
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForImageTextToText", "AutoModel"):
        try:
            with torch.device("meta"):
                model = getattr(transformers, auto).from_config(config)
        except (ValueError, AttributeError) as e:
            errors.append(f"{auto}: {e}")
            continue
        targets = _with_experts(model, LoRATargets.from_model(model, "all-linear"))
        return _with_heads(model, model_dir, file, targets), dtype
    raise SpecError(f"--model: cannot build a model from {model_dir!r}: {'; '.join(errors)}")


def _config_dtype(config: Any) -> torch.dtype:
    """The dtype a model config declares (``dtype``, or ``torch_dtype`` before transformers 5); float32,
    what ``from_pretrained`` gives, when it declares none."""
    import torch

    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


def _with_heads(model: Any, model_dir: str, file: AdapterFile, targets: LoRATargets) -> LoRATargets:
    """``targets`` plus the output layer and the embeddings ``file`` has pairs for (served when named, as a
    manager built with the adapter's target modules serves them), with the base weights of those whose
    copies the adapter holds read from the checkpoint."""
    import torch

    from lora_pin.model.attach import model_targets
    from lora_pin.weights.targets import LoRATargets, ModuleSelection, output_layer_keys

    heads = output_layer_keys(model) | {
        k for k, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
    }
    named = sorted(k for k in file.pairs if k in heads)
    if not named:
        return targets
    found, _ = model_targets(model, ModuleSelection(names=tuple(named)))
    weights = _checkpoint_weights(model, model_dir, [k for k in _base_copies(file) if k in named])
    linears = [t for t in targets.linears if t.key not in named] + list(found.linears)
    unserved = {k: why for k, why in targets.unserved.items() if k not in named}
    return LoRATargets.from_linears(linears, fuse=False, unserved=unserved, base_weights=weights)


def _checkpoint_weights(model: Any, model_dir: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """The ``weight`` of each module ``keys`` names, read from the safetensors checkpoint in ``model_dir``
    (one file or an index of shards) under the name the model gives that parameter (a tied ``lm_head``
    reads the embedding's).

    Raises:
        SpecError: the checkpoint has no safetensors file holding one of them.
    """
    import json
    import os

    from safetensors import safe_open

    first_name = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    index = os.path.join(model_dir, "model.safetensors.index.json")
    shard_of: dict[str, str] = {}
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shard_of = json.load(f).get("weight_map", {})
    weights = {}
    for key in keys:
        name = first_name[id(model.get_submodule(key).weight)]
        path = os.path.join(model_dir, shard_of.get(name, "model.safetensors"))
        try:
            with safe_open(path, framework="pt") as f:
                weights[key] = f.get_tensor(name)
        except (OSError, KeyError, ValueError) as e:
            raise SpecError(
                f"--model: cannot read {name!r} from {path!r} to check the adapter's copy of {key!r}'s base "
                f"weight: {e}"
            ) from e
    return weights


def _with_experts(model: Any, targets: LoRATargets) -> LoRATargets:
    """``targets`` and every MoE expert weight of ``model`` lora_pin can serve (the others listed as
    unserved, with the reason)."""
    from lora_pin.model.attach import model_targets
    from lora_pin.model.experts import ExpertLayout, expert_layout
    from lora_pin.weights.targets import LoRATargets, ModuleSelection

    layouts = {key: expert_layout(m) for key, m in model.named_modules()}
    served = [f"{k}.{n}" for k, lay in layouts.items() if isinstance(lay, ExpertLayout) for n in lay.features]
    unservable = {k for k, lay in layouts.items() if isinstance(lay, str)}
    if not served and not unservable:
        return targets
    linears = list(targets.linears)
    unserved: dict[str, str] = {}
    if served:
        experts, _ = model_targets(model, ModuleSelection(parameters=tuple(served)))
        linears += [t for t in experts.linears if t.experts]
        # Only the expert weights' entries: the linears' would speak of a manager's lora_target_modules.
        unserved = {
            k: why
            for k, why in experts.unserved.items()
            if isinstance(layouts.get(k.rpartition(".")[0]), ExpertLayout)
        }
    for key in unservable:
        why = layouts[key]
        assert isinstance(why, str)
        module = model.get_submodule(key)
        unserved.update(
            {f"{key}.{n}": why for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
        )
    return LoRATargets.from_linears(linears, fuse=False, unserved=unserved)


def run(args: argparse.Namespace) -> int:
    """Prints the adapter summary on stdout; returns 0.

    Raises:
        AdapterLoadError: (and its subclasses UnsafeFormatError, PathNotAllowedError) the adapter cannot be
            served; the CLI prints the message and exits 2.
        SpecError: ``--model`` has no LoRA-able linear layer.
    """
    import torch

    from lora_pin.weights.config import layer_index
    from lora_pin.weights.host_tier import load_adapter
    from lora_pin.weights.reader import open_adapter

    file = open_adapter(args.path, args.path, allowed_roots=args.allowed_root, allow_pickle=args.allow_pickle)
    _check_standalone(file)
    config = file.config
    dtype = getattr(torch, args.dtype or "bfloat16")
    digest = None
    if args.model is not None:
        targets, model_dtype = _model_targets(args.model, file)
        dtype = getattr(torch, args.dtype) if args.dtype else model_dtype
        max_rank = (
            args.max_rank if args.max_rank is not None else max(p.a_shape[0] for p in file.pairs.values())
        )
        digest = load_adapter(
            args.path,
            args.path,
            targets,
            max_rank=max_rank,
            dtype=dtype,
            allowed_roots=args.allowed_root,
            allow_pickle=args.allow_pickle,
            pin_memory=False,
        ).digest
    # Each module's rank from its tensors; an expert weight's (its tensors stack every expert) from the
    # config, by the target_parameters entry (--model checks it against the tensors).
    experts = _expert_pair_keys(file)
    rank_of = {k: p.a_shape[0] for k, p in file.pairs.items() if k not in experts}
    if experts:
        rank_of.update({entry: config.rank_for(entry) for entry in config.target_parameters})
    if args.model is None and args.max_rank is not None:
        too_big = {k: r for k, r in rank_of.items() if r > args.max_rank}
        if too_big:
            raise AdapterLoadError(
                f"adapter {args.path!r} ({file.weights_path}): ranks above the max rank {args.max_rank}: "
                f"{too_big}"
            )
    ranks = sorted(set(rank_of.values()))
    scalings = sorted({config.scaling_for(k, r) for k, r in rank_of.items()})
    alphas = sorted({config.alpha_for(k) for k in rank_of})
    modules = sorted({k.rsplit(".", 1)[-1] for k in file.pairs if k not in experts})
    layers = sorted({i for k in file.pairs if (i := layer_index(k)) is not None})
    element = torch.empty((), dtype=dtype).element_size()
    params = sum(p.a_shape[0] * p.a_shape[1] + p.b_shape[0] * p.b_shape[1] for p in file.pairs.values())
    # A DoRA module's slot also holds its factor, one per output feature.
    factors = sum(p.b_shape[0] for p in file.pairs.values()) if config.use_dora else 0
    lines = [
        f"adapter:        {file.directory}",
        f"weights:        {file.weights_path.name} ({str(file.dtype).removeprefix('torch.')}, "
        f"{file.file_bytes} bytes)",
        f"rank:           {', '.join(map(str, ranks))}",
        f"alpha:          {', '.join(f'{a:g}' for a in alphas)}",
        f"scaling:        {', '.join(f'{s:g}' for s in scalings)}{' (rslora)' if config.use_rslora else ''}",
        f"target modules: {', '.join(modules) or 'none'}",
        f"layers:         {len(layers)} ({', '.join(map(str, layers))})",
        f"tensors:        {2 * len(file.pairs) + (len(file.pairs) if config.use_dora else 0)}",
        f"device bytes:   {(params + factors) * element} ({str(dtype).removeprefix('torch.')})",
    ]
    if config.use_dora:
        lines.insert(
            -2,
            f"dora:           yes (a magnitude per output feature of {len(file.pairs)} modules; "
            f"factors {factors * element} bytes of the device bytes)",
        )
    if experts:
        lines.insert(-3, f"expert weights: {', '.join(config.target_parameters)}")
    if copies := _base_copies(file):
        checked = (
            "equal to the model's" if args.model is not None else "checked against the model when served"
        )
        lines.insert(-1, f"base copies:    {', '.join(sorted(copies))} (PEFT's; {checked})")
    if digest is None and not experts:
        digest = file.standalone_digest()
    lines.append(f"digest:         {digest or 'needs --model (MoE expert weights)'}")
    if args.model is not None:
        lines.append(f"model:          {args.model} (validated)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
