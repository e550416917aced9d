"""The model's LoRA-able linear layers and how they are grouped into pool buffers.

A :class:`LoRATargets` lists the linear modules LoRA may wrap, each by its full module key as PEFT names it
(``model.layers.0.self_attn.q_proj``, ``transformer.h.0.mlp.c_proj``,
``model.vision_tower.encoder.layers.0.self_attn.q_proj``), with their in/out features, and groups them:
with ``fuse=True`` the q/k/v of one parent module become one ``qkv_proj`` group of three slices and its
gate/up one ``gate_up_proj`` group of two slices (one shrink serves all slices); every other module is a
group of one slice. The serving manager wraps exactly these groups; the host tier and the device pool store
one A and one B per group, keyed by :attr:`TargetGroup.key`. Two modules with the same short name in one
layer (GPT-2's ``attn.c_proj`` and ``mlp.c_proj``, an encoder's and a decoder's ``layers.0.self_attn.q_proj``)
are two targets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from lora_pin._core import PatternSet
from lora_pin.errors import AdapterLoadError, SpecError
from lora_pin.weights.config import layer_index
from lora_pin.weights.patterns import compile_patterns

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "FUSED_GROUPS",
    "LinearKind",
    "LinearTarget",
    "LoRATargets",
    "ModuleSelection",
    "TargetGroup",
    "linear_kind",
    "register_linear",
]

DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class LinearTarget:
    """One LoRA-able linear layer: ``key`` is its module path (``model.layers.0.self_attn.q_proj``),
    ``module`` its last segment and ``layer`` the index of the numbered layer it sits in by PEFT's
    layer-index rule (None outside every numbered layer: a projector between towers, say).

    An ``embedding`` target (an ``nn.Embedding``) has ``in_features`` its number of embeddings and
    ``out_features`` its embedding width: its adapter A is ``[r, num_embeddings]`` and B
    ``[embedding_dim, r]``, stored like a linear's, and each token looks up its column of A.

    An ``experts`` target (``experts`` > 0) is a 3-D MoE expert weight, PEFT's ``target_parameters``: ``key``
    is the parameter's (``model.layers.0.mlp.experts.gate_up_proj``), ``module`` its name, and
    ``in_features`` / ``out_features`` one expert's projection widths. Its group stores one slice per
    expert (see :class:`TargetGroup`). ``peft_swapped``: PEFT takes such a weight stored ``[E, in, out]``
    on a module not marked ``is_transposed`` (Llama 4's experts) for ``[E, out, in]``, so its adapter
    files hold lora_A ``[r * E, out]`` and lora_B ``[in, r * E]``: the same delta, the factors' roles
    swapped."""

    layer: int | None
    module: str
    key: str
    in_features: int
    out_features: int
    embedding: bool = False
    experts: int = 0
    peft_swapped: bool = False


@dataclass(frozen=True)
class TargetGroup:
    """The modules that share one pool buffer: one slice per member, stacked along the output dimension.

    ``slice_offsets`` has ``n_slices + 1`` entries: slice s owns output rows
    ``[slice_offsets[s], slice_offsets[s + 1])`` of B. Members of a fused group share one parent module.
    An experts group has one member (a 3-D expert weight of ``E`` experts) and ``E`` slices, expert e's
    A in slice e's rows and its B in slice e's output rows, so the pool, the host tier and the ops treat
    it like a fused group of ``E`` equal slices.
    """

    layer: int | None
    name: str
    members: tuple[LinearTarget, ...]

    # The derived figures below are read for every group on every load and step: each is computed once
    # (the fields are frozen), kept in the instance's __dict__, which equality and hashing ignore.

    @cached_property
    def key(self) -> str:
        """The group's own key, what the host tier and the pool store it by: the member's module key for a
        group of one, the members' parent key and the group name for a fused one
        (``model.layers.0.self_attn.qkv_proj``)."""
        if len(self.members) == 1:
            return self.members[0].key
        parent = self.members[0].key.rpartition(".")[0]
        return f"{parent}.{self.name}" if parent else self.name

    @cached_property
    def experts(self) -> int:
        """The number of experts of an experts group, 0 for any other."""
        return self.members[0].experts

    @cached_property
    def n_slices(self) -> int:
        """How many slices are stacked in this group: its modules (1, 2 or 3), or its experts."""
        return self.experts or len(self.members)

    @cached_property
    def in_features(self) -> int:
        """The shared input width of every member."""
        return self.members[0].in_features

    @cached_property
    def out_total(self) -> int:
        """The summed output width of the slices (rows of the group's B)."""
        return sum(self.slice_widths)

    @cached_property
    def slice_widths(self) -> tuple[int, ...]:
        """The output width of each slice."""
        if self.experts:
            return (self.members[0].out_features,) * self.experts
        return tuple(m.out_features for m in self.members)

    @cached_property
    def slice_offsets(self) -> tuple[int, ...]:
        """Output row offsets of the slices, ``n_slices + 1`` entries starting at 0."""
        offsets = [0]
        for width in self.slice_widths:
            offsets.append(offsets[-1] + width)
        return tuple(offsets)


@dataclass(frozen=True)
class LinearKind:
    """How lora_pin wraps one class of linear layer (see :func:`register_linear`).

    Attributes:
        features: ``module -> (in_features, out_features)`` of a layer of the class.
        returns_bias: the layer's forward returns ``(out, bias)`` (a serving framework's linear with its bias
            add skipped) instead of a tensor; the LoRA delta is added to ``out``.
    """

    features: Callable[[torch.nn.Module], tuple[int, int]]
    returns_bias: bool = False


def _linear_features(module: torch.nn.Module) -> tuple[int, int]:
    weight = getattr(module, "weight", None)
    if type(weight).__name__ == "DTensor":
        # A linear cut by torch.distributed tensor parallelism (transformers' tp_plan): this process computes
        # the widths of its local shard, [out, in] as stored.
        local = weight.to_local()  # type: ignore[union-attr]
        return int(local.shape[1]), int(local.shape[0])
    return int(module.in_features), int(module.out_features)  # type: ignore[arg-type]


def _conv1d_features(module: torch.nn.Module) -> tuple[int, int]:
    # transformers' Conv1D (GPT-2 style) stores its weight [in, out]; PEFT reads its shape the same way.
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0]), int(weight.shape[1])


_KINDS: dict[type[torch.nn.Module], LinearKind] = {torch.nn.Linear: LinearKind(_linear_features)}


def register_linear(
    cls: type[torch.nn.Module],
    *,
    features: Callable[[torch.nn.Module], tuple[int, int]] | None = None,
    returns_bias: bool = False,
) -> None:
    """Teach lora_pin a linear layer class of your own (a serving framework's ``ColumnParallelLinear``...).

    Its instances are then wrapped like ``nn.Linear``: the wrapper calls the layer as is and adds each row's
    LoRA delta to its output. Subclasses are covered too, unless they override ``forward`` (register those
    themselves). Registering a class again replaces its entry.

    Args:
        cls: the layer class.
        features: ``module -> (in_features, out_features)``, the layer's input and output widths (of this
            process's shard, for a sharded layer); default ``(module.in_features, module.out_features)``.
        returns_bias: the layer's forward returns ``(out, bias)`` rather than a tensor.

    Raises:
        SpecError: ``cls`` is not an ``nn.Module`` subclass, or ``features`` is not callable.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise SpecError(f"register_linear: {cls!r} is not a torch.nn.Module subclass")
    if features is not None and not callable(features):
        raise SpecError(f"register_linear: features must be callable, got {type(features).__name__}")
    _KINDS[cls] = LinearKind(features or _linear_features, bool(returns_bias))


def linear_kind(module: torch.nn.Module) -> LinearKind | None:
    """How to wrap ``module`` (also one already wrapped by PEFT or a framework, through its
    ``base_layer``), or None if it is not a linear layer lora_pin knows.

    A subclass of ``torch.nn.Linear`` that overrides ``forward`` is known as a linear, as PEFT wraps it
    (Falcon's ``FalconLinear`` adds its bias after the matmul): the wrapper checks at run time that its
    output is a tensor, and refuses one that returns something else (a router's tuple). A subclass of a
    class registered with :func:`register_linear` that overrides ``forward`` is not known: what it returns
    cannot be told from the class it subclasses.
    """
    base = getattr(module, "base_layer", None)
    if isinstance(base, torch.nn.Module):
        module = base
    cls = type(module)
    if cls in _KINDS:
        return _KINDS[cls]
    if cls.__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor):
        return LinearKind(_conv1d_features)
    for parent in cls.__mro__[1:]:
        kind = _KINDS.get(parent)
        if kind is not None:
            return kind if cls.forward is parent.forward or parent is torch.nn.Linear else None
    return None


def overrides_linear_forward(module: torch.nn.Module) -> bool:
    """Whether ``module`` subclasses a known linear class but computes its own forward (so
    :func:`linear_kind` does not know it)."""
    cls = type(module)
    return any(issubclass(cls, known) and cls.forward is not known.forward for known in _KINDS)


def output_layer_keys(model: torch.nn.Module) -> set[str]:
    """The keys of the model's output layer (``lm_head``): what ``get_output_embeddings()`` returns, and any
    module named ``lm_head``. PEFT's ``all-linear`` leaves it out too."""
    found = {key for key, _ in model.named_modules() if key.rpartition(".")[2] == "lm_head"}
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if isinstance(head, torch.nn.Module):
        found.update(key for key, module in model.named_modules() if module is head)
    return found


def linear_features(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer lora_pin knows (:func:`linear_kind`), else None."""
    kind = linear_kind(module)
    if kind is None:
        return None
    base = getattr(module, "base_layer", None)
    return kind.features(base if isinstance(base, torch.nn.Module) else module)


@dataclass(frozen=True)
class ModuleSelection:
    """The module keys a PEFT ``target_modules`` selects (before ``layers_to_transform``).

    Attributes:
        names: the entries of a list: each selects the key equal to it or ending in ``.entry`` (``q_proj``
            selects every ``...q_proj``, ``mlp.c_proj`` only the MLP's ``c_proj``).
        patterns: regex strings, each selecting the keys it matches whole; ``all-linear`` selects every key.
        parameters: PEFT ``target_parameters`` entries, which select MoE expert parameter keys
            (``model.layers.0.mlp.experts.gate_up_proj``) by the same rule as ``names``; names and patterns
            never select a parameter (an adapter on a shared expert's ``down_proj`` linear does not make
            every routed expert's ``down_proj`` a target).
    """

    names: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Regexes match with the core's linear-time matcher, compiled once (never Python's backtracking
        # ``re``: a target regex may come from an untrusted adapter config).
        regexes = [p for p in self.patterns if p != "all-linear"]
        matcher = None
        if regexes:
            try:
                matcher = compile_patterns(
                    "target modules",
                    regexes,
                    [f"regex {p!r}" for p in regexes],
                    peft_forms=regexes,
                    anchoring="full",
                )
            except AdapterLoadError as exc:
                raise SpecError(str(exc)) from None
        object.__setattr__(self, "_matcher", matcher)

    @classmethod
    def of(cls, target_modules: Sequence[str] | str, parameters: Sequence[str] = ()) -> ModuleSelection:
        """The selection of one ``target_modules`` value (a list of names, or one regex string) and of the
        expert weights ``parameters`` names (PEFT's ``target_parameters``).

        Raises:
            SpecError: the regex is refused (not a regex, or a construct the linear-time matcher lacks; see
                :mod:`lora_pin.weights.patterns`).
        """
        extra = tuple(dict.fromkeys(parameters))
        if isinstance(target_modules, str):
            return cls(patterns=(target_modules,), parameters=extra)
        return cls(names=tuple(dict.fromkeys(target_modules)), parameters=extra)

    def union(self, other: ModuleSelection) -> ModuleSelection:
        """The keys either selection selects."""
        return ModuleSelection(
            tuple(dict.fromkeys(self.names + other.names)),
            tuple(dict.fromkeys(self.patterns + other.patterns)),
            tuple(dict.fromkeys(self.parameters + other.parameters)),
        )

    def selects_parameter(self, key: str) -> bool:
        """Whether the expert parameter with key ``key`` is selected (by a ``parameters`` entry)."""
        return any(key == p or key.endswith(f".{p}") for p in self.parameters)

    def selects(self, key: str) -> bool:
        """Whether the module with key ``key`` is selected."""
        if any(key == n or key.endswith(f".{n}") for n in self.names):
            return True
        if "all-linear" in self.patterns:
            return True
        if not key:
            return False  # the model itself is never a target
        matcher: PatternSet | None = self.__dict__["_matcher"]
        return matcher is not None and matcher.first_match(key) is not None

    def unmatched(self, keys: Iterable[str]) -> list[str]:
        """The entries (names, patterns, then parameters that are no name) that select none of ``keys``
        (module and expert parameter keys)."""
        keys = list(keys)
        entries = [ModuleSelection(names=(n,)) for n in self.names]
        entries += [ModuleSelection(patterns=(p,)) for p in self.patterns]
        unmatched = [(e.names + e.patterns)[0] for e in entries if not any(e.selects(k) for k in keys)]
        extra = [p for p in self.parameters if p not in self.names]
        return unmatched + [p for p in extra if not any(k == p or k.endswith(f".{p}") for k in keys)]

    def __str__(self) -> str:
        parts = [repr(list(self.names))] if self.names else []
        parts += [f"regex {p!r}" for p in self.patterns]
        extra = [p for p in self.parameters if p not in self.names]
        parts += [f"parameters {extra!r}"] if extra else []
        return " or ".join(parts) or "nothing"


@dataclass(frozen=True)
class LoRATargets:
    """Every LoRA-able linear of a model and its buffer groups, in the model's module order.

    Equal targets (same keys, dimensions and grouping) compare equal, so a host adapter loaded for one
    instance fits a pool built from another. ``unserved`` maps the keys of the model's other modules an
    adapter might name to why they are not targets (for error messages; not compared). ``base_weights``
    maps the keys of the embedding and output-layer targets to the model's weight of that module (not
    compared): PEFT saves a copy of it in the adapter, which is accepted only when equal to it.
    """

    linears: tuple[LinearTarget, ...]
    groups: tuple[TargetGroup, ...]
    num_layers: int
    unserved: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    base_weights: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_linears(
        cls,
        linears: Iterable[LinearTarget],
        *,
        fuse: bool = True,
        unserved: Mapping[str, str] | None = None,
        base_weights: Mapping[str, torch.Tensor] | None = None,
    ) -> LoRATargets:
        """Group ``linears`` (kept in their order): the q/k/v and the gate/up of one parent module fused when
        ``fuse`` and all members share one input width.

        Raises:
            SpecError: two targets share a key, or there are none.
        """
        ordered = list(linears)
        keys = [t.key for t in ordered]
        if len(set(keys)) != len(keys):
            raise SpecError(f"model targets: duplicate module keys in {keys}")
        if not ordered:
            raise SpecError(
                "model targets: the model has no LoRA-able linear layer among the requested names"
            )
        by_parent: dict[str, list[LinearTarget]] = {}
        for t in ordered:
            by_parent.setdefault(t.key.rpartition(".")[0], []).append(t)
        groups: list[TargetGroup] = []
        for siblings in by_parent.values():
            by_module = {t.module: t for t in siblings}
            grouped: set[str] = set()
            if fuse:
                for group_name, names in FUSED_GROUPS.items():
                    present = [by_module[n] for n in names if n in by_module]
                    if len(present) == len(names) and len({m.in_features for m in present}) == 1:
                        groups.append(TargetGroup(present[0].layer, group_name, tuple(present)))
                        grouped.update(names)
            groups.extend(TargetGroup(t.layer, t.module, (t,)) for t in siblings if t.module not in grouped)
        order = {key: i for i, key in enumerate(keys)}
        groups.sort(key=lambda g: order[g.members[0].key])
        clashes = sorted(k for k, n in Counter(g.key for g in groups).items() if n > 1)
        if clashes:
            raise SpecError(
                f"model targets: the fused group key(s) {clashes} are also the key of a module of the model"
            )
        layers = {t.layer for t in ordered if t.layer is not None}
        return cls(tuple(ordered), tuple(groups), len(layers), dict(unserved or {}), dict(base_weights or {}))

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, target_modules: Sequence[str] | str | None = None, *, fuse: bool = True
    ) -> LoRATargets:
        """Find the linear layers ``target_modules`` selects, with PEFT's meaning (a list of names or a regex,
        see :class:`ModuleSelection`; default :data:`DEFAULT_TARGET_MODULES`).

        A module qualifies when it is selected (the model's output layer, :func:`output_layer_keys`, only by
        a name or a regex: ``all-linear`` leaves it out, as PEFT's does) and it is a linear layer lora_pin
        knows (:func:`linear_kind`), or wraps one as ``base_layer`` (a PEFT-wrapped model). Works on models
        built on the ``meta`` device.

        Raises:
            SpecError: no module qualifies, or the regex is refused.
        """
        selection = ModuleSelection.of(DEFAULT_TARGET_MODULES if target_modules is None else target_modules)
        found: list[LinearTarget] = []
        output = output_layer_keys(model)
        for key, module in model.named_modules():
            if not selection.selects(key) or (key in output and "all-linear" in selection.patterns):
                continue
            features = linear_features(module)
            if features is None:
                continue
            found.append(
                LinearTarget(layer_index(key), key.rpartition(".")[2], key, features[0], features[1])
            )
        return cls.from_linears(found, fuse=fuse)

    def __iter__(self) -> Iterator[TargetGroup]:
        return iter(self.groups)

    def linear(self, key: str) -> LinearTarget | None:
        """The target with module key ``key``, or None."""
        return self._by_key().get(key)

    def group_of(self, key: str) -> tuple[TargetGroup, int]:
        """The group holding module ``key`` and its slice index there.

        Raises:
            KeyError: ``key`` is not a target.
        """
        return self._slot_of()[key]

    def group(self, key: str) -> TargetGroup:
        """The group whose :attr:`TargetGroup.key` is ``key`` (``model.layers.0.self_attn.qkv_proj``).

        Raises:
            KeyError: no such group.
        """
        group = self._groups_by_key().get(key)
        if group is None:
            raise KeyError(f"no LoRA target group {key!r}")
        return group

    @property
    def module_names(self) -> tuple[str, ...]:
        """The distinct module names (``q_proj`` …) in first-seen order."""
        return tuple(dict.fromkeys(t.module for t in self.linears))

    def _by_key(self) -> dict[str, LinearTarget]:
        cache = self.__dict__.get("_by_key_cache")
        if cache is None:
            cache = {t.key: t for t in self.linears}
            object.__setattr__(self, "_by_key_cache", cache)
        return cache

    def _groups_by_key(self) -> dict[str, TargetGroup]:
        cache = self.__dict__.get("_groups_by_key_cache")
        if cache is None:
            cache = {g.key: g for g in self.groups}
            object.__setattr__(self, "_groups_by_key_cache", cache)
        return cache

    def _slot_of(self) -> dict[str, tuple[TargetGroup, int]]:
        cache = self.__dict__.get("_slot_of_cache")
        if cache is None:
            cache = {m.key: (g, s) for g in self.groups for s, m in enumerate(g.members)}
            object.__setattr__(self, "_slot_of_cache", cache)
        return cache
