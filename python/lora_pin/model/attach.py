"""Finding the model modules LoRA wraps, including fused projections, and swapping wrappers in and out."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from lora_pin.errors import SpecError
from lora_pin.model.experts import ExpertLayout, LoRAExperts, expert_layout
from lora_pin.model.layers import LoRAEmbedding, LoRALinear
from lora_pin.model.parallel_layers import wrap_parallel
from lora_pin.model.segments import StepSegments
from lora_pin.ops.backends import backend_for
from lora_pin.weights import (
    FUSED_GROUPS,
    DevicePool,
    GroupBuffers,
    LinearTarget,
    LoRATargets,
    PagedDevicePool,
)
from lora_pin.weights.config import layer_index
from lora_pin.weights.shards import WHOLE, ShardPlan
from lora_pin.weights.targets import (
    ModuleSelection,
    linear_features,
    linear_kind,
    output_layer_keys,
    overrides_linear_forward,
)

if TYPE_CHECKING:
    from lora_pin.parallel import CollectiveLog, GroupShard

__all__ = ["attach", "base_weights", "detach", "model_targets"]

#: Fused projections of the usual serving-framework models: module name -> (adapter module, width) ...
FusedSpec = Mapping[str, Sequence[tuple[str, int]]]


def model_targets(
    model: torch.nn.Module, selection: ModuleSelection | None, fused_modules: FusedSpec | None = None
) -> tuple[LoRATargets, dict[str, str]]:
    """The LoRA targets of ``model`` and, per target group key, the key of the module computing it.

    ``selection`` is the adapter-side modules to serve, with PEFT's ``target_modules`` meaning (names match
    the end of a module key, regexes the whole key); None serves every linear layer but the output layer
    (``--lora-target-modules all``, PEFT's ``all-linear``); the output layer (``lm_head``) and the
    embeddings are served when ``selection`` selects them (a tied ``lm_head`` only reads the embedding's
    weight). Targets are keyed by their full module path, so modules sharing a short name (GPT-2's
    ``attn.c_proj`` and ``mlp.c_proj``, a vision tower's and a language model's
    ``layers.0.self_attn.q_proj``, an encoder's and a decoder's) are separate targets.
    MoE expert weights (a transformers experts module's 3-D ``gate_up_proj`` / ``down_proj``, PEFT's
    ``target_parameters``) are targets keyed by the parameter (``model.layers.0.mlp.experts.gate_up_proj``)
    when ``selection`` names them (:meth:`ModuleSelection.selects_parameter`); ``['all']`` leaves them
    out, as PEFT's ``all-linear`` does, and an experts module lora_pin cannot compute is refused when
    named (see :func:`~lora_pin.model.experts.expert_layout`).
    ``fused_modules`` maps a fused model module to the adapter modules stacked in its output, in order,
    with their widths, e.g. ``{"qkv_proj": [("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)]}``:
    adapters trained on separate projections are then served by one shrink and one expand over the fused
    output.

    Raises:
        SpecError: a selected module subclasses a registered linear class (not ``torch.nn.Linear``, whose
            subclasses are wrapped and their output checked at run time) but computes its own forward; a
            selected expert weight belongs to an experts module lora_pin cannot serve; a fused
            module's widths do not add up to its output, or its members are not those of a known fused group
            (``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up); or no module qualifies.
    """
    found = _Found(selection, dict(fused_modules or {}), output_layer_keys(model))
    for key, module in model.named_modules():
        if isinstance(module, (LoRALinear, LoRAExperts)):
            raise SpecError(
                f"{key!r} is already wrapped by another LoRAManager; detach() that one first (one manager "
                "per model: a second would wrap the first's wrappers)"
            )
        layout = expert_layout(module)
        if layout is not None:
            found.linears += _expert_targets(key, module, layout, selection, found.module_of, found.unserved)
        elif isinstance(module, torch.nn.Embedding):
            found.embedding(key, module)
        elif overrides_linear_forward(module) and linear_kind(module) is None:
            found.refuse_own_forward(key, module)
        elif (features := linear_features(module)) is not None:
            found.linear(key, module, features)
    return found.targets()


class _Found:
    """What :func:`model_targets` has found so far, and the rule for each kind of module it meets."""

    def __init__(
        self, selection: ModuleSelection | None, fused: dict[str, Sequence[tuple[str, int]]], output: set[str]
    ) -> None:
        self.selection = selection
        self.fused = fused
        self.output = output
        self.known = {members: group for group, members in FUSED_GROUPS.items()}
        self.linears: list[LinearTarget] = []
        self.module_of: dict[str, str] = {}
        self.unserved: dict[str, str] = {}
        self.base_weights: dict[str, torch.Tensor] = {}

    def named(self, key: str) -> bool:
        """Whether the selection names ``key`` (``['all']`` names nothing: it takes every linear layer)."""
        return self.selection is not None and self.selection.selects(key)

    def embedding(self, key: str, module: torch.nn.Embedding) -> None:
        """An embedding is a target when named (PEFT's all-linear leaves it out)."""
        if not self.named(key):
            self.unserved[key] = _served_when_named("an embedding", self.selection)
            return
        name = key.rpartition(".")[2]
        self.linears.append(
            LinearTarget(layer_index(key), name, key, module.num_embeddings, module.embedding_dim, True)
        )
        self.module_of[key] = key
        if module.weight.device.type != "meta":
            self.base_weights[key] = module.weight

    def refuse_own_forward(self, key: str, module: torch.nn.Module) -> None:
        """A subclass of a registered linear class computing its own forward: refused when named, else
        left out with the reason."""
        why = (
            f"{key!r} ({type(module).__name__}) subclasses a registered linear class but overrides its "
            "forward, so what it returns cannot be told from that class: it cannot be wrapped"
        )
        if self.named(key):
            raise SpecError(
                f"{why}. Leave it out of lora_target_modules, or teach lora_pin its output with "
                "lora_pin.register_linear(cls, returns_bias=...) if it is a linear layer"
            )
        self.unserved[key] = why

    def linear(self, key: str, module: torch.nn.Module, features: tuple[int, int]) -> None:
        """A linear layer: the output layer only when named, a fused module's members, or itself when
        selected."""
        parent, _, name = key.rpartition(".")
        selected = self.selection is None or self.selection.selects(key)
        if key in self.output and not self.named(key):
            self.unserved[key] = _served_when_named("the model's output layer", self.selection)
        elif name in self.fused:
            self._fused(key, parent, name, features)
        elif selected:
            self.linears.append(LinearTarget(layer_index(key), name, key, features[0], features[1]))
            self.module_of[key] = key
            weight = getattr(module, "weight", None)
            if key in self.output and isinstance(weight, torch.Tensor) and weight.device.type != "meta":
                self.base_weights[key] = weight
        else:
            self.unserved[key] = (
                f"this manager does not wrap it: lora_target_modules selects {self.selection}; build the "
                "manager with lora_target_modules= naming it (or ['all'])"
            )

    def _fused(self, key: str, parent: str, name: str, features: tuple[int, int]) -> None:
        """A fused module (``fused_modules``): one target per member, computed by ``key``.

        Raises:
            SpecError: its members are not a known fused group, or their widths do not add up.
        """
        spec = list(self.fused[name])
        fused_group = self.known.get(tuple(m for m, _ in spec))
        if fused_group is None:
            raise SpecError(
                f"fused module {name!r} lists {[m for m, _ in spec]}; a fused module must stack one of "
                f"{ {g: list(m) for g, m in FUSED_GROUPS.items()} }"
            )
        if sum(w for _, w in spec) != features[1]:
            raise SpecError(
                f"fused module {key!r} has {features[1]} outputs but its members' widths "
                f"{[w for _, w in spec]} add up to {sum(w for _, w in spec)}"
            )
        index = layer_index(key)
        for member, width in spec:
            self.linears.append(LinearTarget(index, member, f"{parent}.{member}", features[0], width))
        self.module_of[f"{parent}.{fused_group}" if parent else fused_group] = key

    def targets(self) -> tuple[LoRATargets, dict[str, str]]:
        """The targets found and the module computing each group.

        Raises:
            SpecError: nothing qualified, or a fused group's members live in separate modules.
        """
        if not self.linears:
            wanted = "any name" if self.selection is None else f"selected by {self.selection}"
            raise SpecError(
                f"the model has no linear layer {wanted} (lora_target_modules= "
                "chooses the modules to serve; ['all'] serves every linear layer)"
            )
        targets = LoRATargets.from_linears(
            self.linears, fuse=bool(self.fused), unserved=self.unserved, base_weights=self.base_weights
        )
        for group in targets.groups:
            if group.key not in self.module_of:
                raise SpecError(
                    f"{[m.key for m in group.members]} would be served fused as {group.key!r}, but the model "
                    "computes them in separate modules; do not pass fused_modules for a model with separate "
                    "projections"
                )
        return targets, self.module_of


def _expert_targets(
    key: str,
    module: torch.nn.Module,
    layout: ExpertLayout | str,
    selection: ModuleSelection | None,
    module_of: dict[str, str],
    unserved: dict[str, str],
) -> list[LinearTarget]:
    """The targets of the experts module ``module`` (at ``key``): one per expert weight ``selection``
    names; the others go to ``unserved`` with the reason, and so does every weight of a module lora_pin
    cannot serve (``layout`` a string), which is refused when named."""
    found = []
    for name, param in module.named_parameters(recurse=False):
        if param.dim() != 3:
            continue
        parameter_key = f"{key}.{name}"
        named = selection is not None and selection.selects_parameter(parameter_key)
        if isinstance(layout, str) or name not in layout.features:
            why = (
                layout
                if isinstance(layout, str)
                else f"lora_pin serves expert LoRA on {list(layout.features)}"
            )
            if named:
                raise SpecError(f"expert weight {parameter_key!r} cannot be served: {why}")
            unserved[parameter_key] = why
        elif named:
            in_features, out_features = layout.features[name]
            found.append(
                LinearTarget(
                    layer_index(parameter_key),
                    name,
                    parameter_key,
                    in_features,
                    out_features,
                    experts=layout.num_experts,
                    peft_swapped=layout.peft_swapped,
                )
            )
            module_of[parameter_key] = key
        else:
            unserved[parameter_key] = _served_when_named("a MoE expert weight", selection)
    return found


def _served_when_named(what: str, selection: ModuleSelection | None) -> str:
    """Why ``what`` (an embedding, the output layer: served only when named, since PEFT's all-linear
    leaves both out) is not a target of a manager wrapping ``selection`` (None: ``['all']``)."""
    if selection is None:
        return (
            f"it is {what}, which ['all'] leaves out (as PEFT's all-linear does); build the manager with "
            "lora_target_modules= naming it"
        )
    return (
        f"this manager does not wrap it: lora_target_modules selects {selection}; build the manager with "
        "lora_target_modules= naming it"
    )


def attach(
    model: torch.nn.Module,
    targets: LoRATargets,
    module_of: Mapping[str, str],
    pool: DevicePool | PagedDevicePool,
    active_step: Callable[[], StepSegments | None],
    shards: ShardPlan[GroupShard] = WHOLE,
    log: CollectiveLog | None = None,
) -> dict[str, torch.nn.Module]:
    """Wrap the module of every target group (``module_of``: group key -> module key, from
    :func:`model_targets`) with a :class:`LoRALinear` (a :class:`LoRAEmbedding` for an embedding, one
    :class:`~lora_pin.model.experts.LoRAExperts` for all the served weights of an experts module, a
    :class:`~lora_pin.model.parallel_layers.ParallelLoRALinear` for a layer ``shards`` cuts); returns the
    originals by module key. Every layer runs its work through one backend, chosen here once for the
    pool's device."""
    backend = backend_for(pool.device)
    originals: dict[str, torch.nn.Module] = {}
    experts: dict[str, dict[str, GroupBuffers]] = {}
    for group in targets.groups:
        key = module_of[group.key]
        buffers = pool.group_buffers(group.key)
        if group.experts:
            experts.setdefault(key, {})[group.members[0].module] = buffers
            continue
        original = model.get_submodule(key)
        kind = linear_kind(original)
        returns_bias = kind is not None and kind.returns_bias
        parallel = wrap_parallel(original, buffers, active_step, shards, log, backend)
        if parallel is not None:
            _set(model, key, parallel)
        elif group.members[0].embedding:
            _set(model, key, LoRAEmbedding(original, buffers, active_step, backend=backend))
        else:
            wrapper = LoRALinear(
                original, buffers, active_step, returns_bias=returns_bias, key=key, backend=backend
            )
            _set(model, key, wrapper)
        originals[key] = original
    for key, by_name in experts.items():
        original = model.get_submodule(key)
        layout = expert_layout(original)
        assert isinstance(layout, ExpertLayout), "model_targets made targets of an unservable experts module"
        _set(model, key, LoRAExperts(original, layout, by_name, active_step, backend))
        originals[key] = original
    return originals


def base_weights(
    model: torch.nn.Module, targets: LoRATargets, module_of: Mapping[str, str]
) -> dict[str, Callable[[], torch.Tensor | None]]:
    """For each linear target group, a function returning the weight of the module that computes it as
    ``[out_total, in]`` (a transformers ``Conv1D``'s ``[in, out]`` transposed), or None when the module
    keeps no plain weight of that shape (a quantized layer): what a DoRA adapter's factor is computed
    from (:mod:`lora_pin.weights.dora`). A tensor-parallel layer's is this rank's shard (a ``DTensor``'s
    local part), with the layer's local widths. Read when called, so it is the model's weight then."""
    found: dict[str, Callable[[], torch.Tensor | None]] = {}
    for group in targets.groups:
        if group.experts or group.members[0].embedding:
            continue
        module = model.get_submodule(module_of[group.key])
        found[group.key] = functools.partial(_plain_weight, module, group.out_total, group.in_features)
    return found


def _plain_weight(module: torch.nn.Module, out_features: int, in_features: int) -> torch.Tensor | None:
    base = getattr(module, "base_layer", None)
    layer = base if isinstance(base, torch.nn.Module) else module
    weight = getattr(layer, "weight", None)
    if type(weight).__name__ == "DTensor":
        weight = weight.to_local()  # type: ignore[union-attr]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if type(layer).__name__ == "Conv1D":
        weight = weight.t()
    return weight if tuple(weight.shape) == (out_features, in_features) else None


def detach(model: torch.nn.Module, originals: Mapping[str, torch.nn.Module]) -> None:
    """Put every original module back where :func:`attach` wrapped it."""
    for key, original in originals.items():
        _set(model, key, original)


def _set(model: torch.nn.Module, key: str, module: torch.nn.Module) -> None:
    parent_key, _, child = key.rpartition(".")
    parent = model.get_submodule(parent_key) if parent_key else model
    setattr(parent, child, module)
