"""``adapter_config.json``: the fields lora_pin serves, the ones it refuses, and PEFT's matching rules.

Matching follows PEFT 0.21 exactly (``peft/utils/other.py`` and ``peft/tuners/tuners_utils.py``):

* ``target_modules`` as a string is a regex that must ``re.fullmatch`` the module key; as a list, a key
  matches when it equals an entry or ends with ``"." + entry``. ``layers_to_transform`` (and
  ``layers_pattern``) only apply to the list form; PEFT refuses them with a string.
* ``rank_pattern`` / ``alpha_pattern``: the first key (in file order) for which
  ``re.match(rf"(.*\\.)?({key})$", module_key)`` succeeds gives the value; otherwise ``r`` / ``lora_alpha``.
* scaling is ``alpha / sqrt(r)`` with ``use_rslora``, else ``alpha / r``, with the module's own r and alpha.
* ``target_parameters`` (LoRA on a module's 3-D MoE expert weights): a parameter key
  (``model.layers.0.mlp.experts.gate_up_proj``) matches when it equals an entry or ends with ``"." + entry``;
  ``exclude_modules`` and ``layers_to_transform`` do not apply to it (PEFT's ``_inject_parameters``), and its
  rank and alpha come from ``rank_pattern`` / ``alpha_pattern`` by the parameter key.

The regexes give those answers without Python's backtracking ``re``: each field's patterns are compiled
once, when the config is built, into a linear-time matcher (:mod:`lora_pin.weights.patterns`), which
refuses, naming it, the syntax it cannot match as ``re`` does.

Stricter than PEFT where PEFT's leniency serves wrong output silently: ``lora_alpha`` (PEFT's default 8 when
the key is absent, as PEFT itself loads such a file) and every ``alpha_pattern`` value must be positive and
in float32's normal range (zero turns the adapter into the base model, a negative value inverts it, and
the scaling is applied in float32, where ``1e39 / r`` is inf; ``null`` or a string is what a broken export
looks like). Ranks above :data:`~lora_pin.weights.limits.MAX_ADAPTER_RANK` and
config files above :data:`~lora_pin.weights.limits.MAX_CONFIG_BYTES` are refused before anything is sized
from them.

Module keys are relative to the base model, e.g. ``model.layers.0.self_attn.q_proj``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lora_pin._core import PatternSet
from lora_pin.errors import AdapterLoadError
from lora_pin.weights.limits import MAX_ADAPTER_RANK
from lora_pin.weights.patterns import MAX_PATTERN_ENTRIES, compile_patterns

__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "AdapterConfig", "layer_index"]

# PEFT's default layer-index rule: the first numbered segment after at least two name segments. A fixed
# pattern, not a config's, so Python's re serves.
_LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")

# float32's largest value and smallest normal value: the registry and the device pool store each module's
# scaling as float32 and the kernels apply it in float32 (also for fp16 and bf16 models).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


def layer_index(module_key: str) -> int | None:
    """The decoder layer index in ``module_key`` by PEFT's default rule, or None when it has none.

    ``model.layers.3.mlp.down_proj`` -> 3. A config's ``layers_pattern`` is applied by
    :meth:`AdapterConfig.targets`.
    """
    match = _LAYER_INDEX.match(module_key)
    return None if match is None else int(match.group("idx"))


# init_lora_weights values whose PEFT initialisation also rewrites the base layer's weight (PiSSA and its
# pissa_niter_N form, OLoRA, CorDA, LoftQ, LoRA-GA).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

_UNSUPPORTED = {
    "lora_bias": "adds a bias to lora_B",
    "trainable_token_indices": "trains embedding rows",
    "layer_replication": "changes the base model's layer stack",
    "use_qalora": "pools the input before lora_A",
    "alora_invocation_tokens": "activates the adapter by token position",
}

# Builds the error for a field: fail("r", "must be ...").
_Fail = Callable[[str, str], AdapterLoadError]


@dataclass(frozen=True)
class _Matchers:
    """An :class:`AdapterConfig`'s patterns compiled once (None where the field has none), and its lists
    as sets, so that matching a module key costs the same whatever the config holds."""

    target: PatternSet | None
    exclude: PatternSet | None
    rank: PatternSet | None
    alpha: PatternSet | None
    layers: PatternSet | None
    rank_values: tuple[int, ...]
    alpha_values: tuple[float, ...]
    target_names: frozenset[str]
    exclude_names: frozenset[str]
    layer_set: frozenset[int] | None


@dataclass(frozen=True)
class AdapterConfig:
    """The servable part of a PEFT LoRA ``adapter_config.json``.

    ``target_modules`` is a tuple of names or one regex string (an empty tuple when the adapter only has
    ``target_parameters``, the names of MoE expert parameters it puts LoRA on); ``layers_to_transform``
    None means all layers. ``use_dora``: a DoRA adapter (each targeted linear also has a
    ``lora_magnitude_vector``, see :mod:`lora_pin.weights.dora`). Build it with
    :func:`lora_pin.weights.reader.read_adapter_config` (or :meth:`from_mapping`), which refuses what
    lora_pin cannot serve. Its regexes are compiled when it is built, once.

    Raises:
        AdapterLoadError: (when built) a pattern is refused, see
            :func:`~lora_pin.weights.patterns.compile_patterns`.
    """

    name: str
    file: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] | str = ()
    fan_in_fan_out: bool = False
    base_model_name_or_path: str | None = None
    target_parameters: tuple[str, ...] = ()
    use_dora: bool = False
    _matchers: _Matchers = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_matchers", _compile(self))

    @classmethod
    def from_mapping(cls, name: str, file: str, data: Mapping[str, Any]) -> AdapterConfig:
        """Validate a parsed ``adapter_config.json`` and keep the fields that matter.

        Raises:
            AdapterLoadError: naming the adapter, the file and the field, for ``peft_type`` other than LORA,
                ``use_dora`` with ``target_parameters``, ``bias`` other than "none", non-empty
                ``modules_to_save``, ``lora_bias``, ``trainable_token_indices``, ``layer_replication``,
                ``use_qalora``, ``alora_invocation_tokens``, for any field of the wrong type or value, for
                more than :data:`~lora_pin.weights.patterns.MAX_PATTERN_ENTRIES` pattern and list entries,
                and for a
                refused regex (see :func:`~lora_pin.weights.patterns.compile_patterns`).
        """

        def fail(field_name: str, why: str) -> AdapterLoadError:
            return AdapterLoadError(f"adapter {name!r} ({file}): field {field_name!r} {why}")

        if not isinstance(data, Mapping):
            raise AdapterLoadError(
                f"adapter {name!r} ({file}): expected a JSON object, got {type(data).__name__}"
            )
        _check_servable(fail, data)
        r, alpha = _rank_and_alpha(fail, data)
        rank_pattern = _pattern_field(fail, data, "rank_pattern")
        alpha_pattern = _pattern_field(fail, data, "alpha_pattern")
        parameters = _target_parameters(fail, data)
        targets = _target_modules(fail, data, bool(parameters))
        layers, layers_pattern = _layers(fail, data, targets)
        exclude = _exclude_modules(fail, data)
        entries = len(rank_pattern) + len(alpha_pattern) + len(layers) + len(layers_pattern)
        entries += sum(len(names) for names in (targets, exclude) if not isinstance(names, str))
        entries += len(parameters)
        if entries > MAX_PATTERN_ENTRIES:
            raise AdapterLoadError(
                f"adapter {name!r} ({file}): {entries} entries in rank_pattern, alpha_pattern and the "
                f"target_modules, exclude_modules, layers_pattern and layers_to_transform lists, above "
                f"the limit MAX_PATTERN_ENTRIES={MAX_PATTERN_ENTRIES}"
            )
        _check_pattern_values(fail, rank_pattern, alpha_pattern)
        return cls(
            name=name,
            file=file,
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets,
            use_rslora=_boolean(fail, data, "use_rslora"),
            rank_pattern=dict(rank_pattern),
            alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
            layers_to_transform=tuple(layers) or None,
            layers_pattern=tuple(layers_pattern),
            exclude_modules=exclude,
            fan_in_fan_out=_boolean(fail, data, "fan_in_fan_out"),
            base_model_name_or_path=data.get("base_model_name_or_path"),
            target_parameters=parameters,
            use_dora=_boolean(fail, data, "use_dora"),
        )

    def rank_for(self, module_key: str) -> int:
        """The rank PEFT gives ``module_key``: its first ``rank_pattern`` entry, else ``r``.

        Raises:
            AdapterLoadError: ``module_key`` holds a character outside printable ASCII and the config has
                a ``rank_pattern`` (see :class:`~lora_pin._core.PatternSet`).
        """
        m = self._matchers
        index = None if m.rank is None else m.rank.first_match(module_key)
        return self.r if index is None else m.rank_values[index]

    def alpha_for(self, module_key: str) -> float:
        """The alpha PEFT gives ``module_key``: its first ``alpha_pattern`` entry, else ``lora_alpha``.

        Raises:
            AdapterLoadError: as :meth:`rank_for`, for ``alpha_pattern``.
        """
        m = self._matchers
        index = None if m.alpha is None else m.alpha.first_match(module_key)
        return self.lora_alpha if index is None else m.alpha_values[index]

    def scaling_for(self, module_key: str, rank: int) -> float:
        """``alpha / sqrt(rank)`` with rslora, else ``alpha / rank``, with ``module_key``'s own alpha.

        Raises:
            AdapterLoadError: the scaling falls outside float32's normal range, in which the registry, the
                pool and the kernels hold and apply it (alphas are bounded above when the config is
                read, so only a tiny alpha over a large rank gets here); or as :meth:`alpha_for`.
        """
        alpha = self.alpha_for(module_key)
        scaling = alpha / math.sqrt(rank) if self.use_rslora else alpha / rank
        if not FLOAT32_TINY <= scaling <= FLOAT32_MAX:
            divisor = f"sqrt({rank})" if self.use_rslora else str(rank)
            raise AdapterLoadError(
                f"adapter {self.name!r} ({self.file}): module {module_key!r} has scaling {scaling!r} "
                f"(alpha {alpha!r} / {divisor}), outside float32's normal range [{FLOAT32_TINY!r}, "
                f"{FLOAT32_MAX!r}] in which lora_pin applies it (fields 'lora_alpha'/'alpha_pattern', "
                "'r'/'rank_pattern')"
            )
        return scaling

    def targets(self, module_key: str) -> bool:
        """Whether PEFT would put this adapter's LoRA on ``module_key`` (exclusions and layers included).

        Raises:
            AdapterLoadError: ``module_key`` holds a character outside printable ASCII and a regex field
                (``target_modules`` or ``exclude_modules`` as a string, ``layers_pattern``) applies.
        """
        m = self._matchers
        if m.exclude is not None:
            if m.exclude.first_match(module_key) is not None:
                return False
        elif _names_match(m.exclude_names, module_key):
            return False
        if isinstance(self.target_modules, str):
            return m.target is None or m.target.first_match(module_key) is not None
        if not _names_match(m.target_names, module_key):
            return False
        if module_key in m.target_names or m.layer_set is None:
            return True
        if m.layers is None:
            index = layer_index(module_key)
        else:
            captured = m.layers.group(module_key, "idx")
            index = None if captured is None else int(captured)
        return index is not None and index in m.layer_set

    def targets_parameter(self, parameter_key: str) -> bool:
        """Whether PEFT would put this adapter's LoRA on the parameter ``parameter_key``
        (``model.layers.0.mlp.experts.down_proj``): it equals a ``target_parameters`` entry or ends with
        ``"." + entry``. Exclusions and layers do not apply, as in PEFT."""
        return any(parameter_key == t or parameter_key.endswith(f".{t}") for t in self.target_parameters)

    def unused_pattern_keys(self, module_keys: Iterable[str]) -> list[tuple[str, str]]:
        """``(field, key)`` for each ``rank_pattern`` / ``alpha_pattern`` key that matches none of
        ``module_keys``, in file order: one pass over each module key, with the GIL released.

        Raises:
            AdapterLoadError: a module key holds a character outside printable ASCII.
        """
        keys = list(module_keys)
        unused = []
        for field_name, matcher in (
            ("rank_pattern", self._matchers.rank),
            ("alpha_pattern", self._matchers.alpha),
        ):
            if matcher is not None:
                pattern_keys = self.rank_pattern if field_name == "rank_pattern" else self.alpha_pattern
                used = matcher.used_by(keys)
                unused += [(field_name, k) for k, u in zip(pattern_keys, used, strict=True) if not u]
        return unused


def _names_match(names: frozenset[str], module_key: str) -> bool:
    """Whether ``module_key`` equals a name or ends with ``"." + name`` (PEFT's list rule), by looking up
    the key and each of its suffixes after a dot."""
    if not names:
        return False
    if module_key in names:
        return True
    dot = module_key.find(".")
    while dot >= 0:
        if module_key[dot + 1 :] in names:
            return True
        dot = module_key.find(".", dot + 1)
    return False


def _compile(config: AdapterConfig) -> _Matchers:
    where = f"adapter {config.name!r} ({config.file}): field"

    def regexes(
        field_name: str,
        patterns: Iterable[str],
        peft_form: Callable[[str], str],
        anchoring: Literal["start", "full", "dotted_suffix"],
        *,
        keyed: bool = False,
    ) -> PatternSet | None:
        patterns = list(patterns)
        if not patterns:
            return None
        labels = [f"key {p!r}" if keyed else repr(p) for p in patterns]
        forms = [peft_form(p) for p in patterns]
        # The set matches a dotted suffix itself; the other fields are compiled as PEFT writes them.
        compiled = patterns if anchoring == "dotted_suffix" else forms
        return compile_patterns(
            f"{where} {field_name!r}", compiled, labels, peft_forms=forms, anchoring=anchoring
        )

    def same(pattern: str) -> str:
        return pattern

    def pattern_key(key: str) -> str:
        return rf"(.*\.)?({key})$"

    def layer(pattern: str) -> str:
        return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."

    targets, exclude = config.target_modules, config.exclude_modules
    target_regex = [targets] if isinstance(targets, str) and targets != "all-linear" else []
    exclude_regex = [exclude] if isinstance(exclude, str) and exclude else []
    return _Matchers(
        target=regexes("target_modules", target_regex, same, "full"),
        exclude=regexes("exclude_modules", exclude_regex, same, "full"),
        rank=regexes("rank_pattern", config.rank_pattern, pattern_key, "dotted_suffix", keyed=True),
        alpha=regexes("alpha_pattern", config.alpha_pattern, pattern_key, "dotted_suffix", keyed=True),
        layers=regexes("layers_pattern", config.layers_pattern, layer, "start"),
        rank_values=tuple(config.rank_pattern.values()),
        alpha_values=tuple(config.alpha_pattern.values()),
        target_names=frozenset(() if isinstance(targets, str) else targets),
        exclude_names=frozenset(() if isinstance(exclude, str) else exclude),
        layer_set=None if config.layers_to_transform is None else frozenset(config.layers_to_transform),
    )


def _check_servable(fail: _Fail, data: Mapping[str, Any]) -> None:
    """Refuse the PEFT features lora_pin cannot serve (each changes what the adapter computes)."""
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail("peft_type", f"is {peft_type!r}; only LORA adapters can be served")
    if data.get("use_dora") and data.get("target_parameters"):
        raise fail(
            "use_dora",
            "is true with target_parameters: DoRA on MoE expert weights cannot be served (PEFT does not "
            "train it either)",
        )
    bias = data.get("bias", "none")
    if bias != "none":
        raise fail("bias", f"is {bias!r}; adapters that train biases cannot be served (must be 'none')")
    if data.get("modules_to_save"):
        raise fail(
            "modules_to_save",
            f"is {data['modules_to_save']!r}; adapters that replace whole modules cannot be served",
        )
    for key, why in _UNSUPPORTED.items():
        if data.get(key):
            raise fail(key, f"is {data[key]!r}; the adapter {why}, which cannot be served")
    init = data.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_CHANGING_INITS):
        raise fail(
            "init_lora_weights",
            f"is {init!r}: that initialisation rewrites the base weights (PEFT rebuilds them when it "
            "loads the adapter), so the adapter is only correct over a base model lora_pin does not "
            "serve; convert it to a plain LoRA first (PEFT's save_pretrained with "
            "path_initial_model_for_weight_conversion)",
        )


def _rank_and_alpha(fail: _Fail, data: Mapping[str, Any]) -> tuple[int, float]:
    """``r`` and ``lora_alpha`` (PEFT's defaults 8 and 8), checked."""
    r = data.get("r", 8)
    if not _positive_int(r):
        raise fail("r", f"must be a positive integer, got {r!r}")
    if r > MAX_ADAPTER_RANK:
        raise fail("r", f"is {r}, above the limit MAX_ADAPTER_RANK={MAX_ADAPTER_RANK}")
    alpha = data.get("lora_alpha", 8)
    if not _float32_alpha(alpha):
        raise fail("lora_alpha", f"must be {_ALPHA_RULE}, got {alpha!r}")
    return r, alpha


def _pattern_field(fail: _Fail, data: Mapping[str, Any], field_name: str) -> Mapping[Any, Any]:
    """``rank_pattern`` or ``alpha_pattern`` as the object it must be; its entries are checked once their
    number is known to be within the limit."""
    patterns = data.get(field_name) or {}
    if not isinstance(patterns, Mapping):
        raise fail(field_name, f"must be an object, got {patterns!r}")
    return patterns


def _check_pattern_values(
    fail: _Fail, rank_pattern: Mapping[Any, Any], alpha_pattern: Mapping[Any, Any]
) -> None:
    """Each ``rank_pattern`` value a rank within the limit, each ``alpha_pattern`` value an alpha, each key
    a string (the regexes themselves are compiled with the config)."""
    for pattern_key, value in rank_pattern.items():
        if not _positive_int(value):
            raise fail("rank_pattern", f"entry {pattern_key!r} must be a positive integer, got {value!r}")
        if value > MAX_ADAPTER_RANK:
            raise fail(
                "rank_pattern",
                f"entry {pattern_key!r} is {value}, above the limit MAX_ADAPTER_RANK={MAX_ADAPTER_RANK}",
            )
    for pattern_key, value in alpha_pattern.items():
        if not _float32_alpha(value):
            raise fail("alpha_pattern", f"entry {pattern_key!r} must be {_ALPHA_RULE}, got {value!r}")
    for field_name, patterns in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        for pattern_key in patterns:
            if not isinstance(pattern_key, str):
                raise fail(field_name, f"key {pattern_key!r} must be a string")


def _target_modules(fail: _Fail, data: Mapping[str, Any], has_parameters: bool) -> tuple[str, ...] | str:
    """``target_modules``: one regex string, or a non-empty list of names (null or empty when the adapter
    has ``target_parameters``)."""
    raw = data.get("target_modules")
    if isinstance(raw, str):
        return raw
    if has_parameters and (raw is None or raw == []):
        return ()
    if isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        return tuple(raw)
    raise fail("target_modules", f"must be a regex string or a non-empty list of names, got {raw!r}")


def _target_parameters(fail: _Fail, data: Mapping[str, Any]) -> tuple[str, ...]:
    """``target_parameters``: a list of parameter names (PEFT takes no regex here); empty for none."""
    raw = data.get("target_parameters")
    if raw is None or raw == []:
        return ()
    if isinstance(raw, list) and all(isinstance(t, str) and t for t in raw):
        return tuple(dict.fromkeys(raw))
    raise fail("target_parameters", f"must be a list of parameter names, got {raw!r}")


def _layers(
    fail: _Fail, data: Mapping[str, Any], targets: tuple[str, ...] | str
) -> tuple[list[int], tuple[str, ...]]:
    """``layers_to_transform`` (an integer or a list; empty for all layers) and ``layers_pattern``."""
    layers = data.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (
        isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    ):
        raise fail("layers_to_transform", f"must be an integer or a list of integers, got {layers!r}")
    layers_pattern = data.get("layers_pattern") or ()
    if isinstance(layers_pattern, str):
        layers_pattern = (layers_pattern,)
    if not isinstance(layers_pattern, (list, tuple)) or not all(isinstance(p, str) for p in layers_pattern):
        raise fail("layers_pattern", f"must be a string or a list of strings, got {layers_pattern!r}")
    if isinstance(targets, str) and (layers or layers_pattern):
        raise fail("layers_to_transform", "cannot be used when target_modules is a regex string (PEFT rule)")
    return layers or [], tuple(layers_pattern)


def _exclude_modules(fail: _Fail, data: Mapping[str, Any]) -> tuple[str, ...] | str:
    """``exclude_modules``: one regex string, or a list of names (empty for none)."""
    exclude = data.get("exclude_modules") or ()
    if isinstance(exclude, str):
        return exclude
    if isinstance(exclude, (list, tuple)) and all(isinstance(m, str) for m in exclude):
        return tuple(exclude)
    raise fail("exclude_modules", f"must be a regex string or a list of names, got {exclude!r}")


def _boolean(fail: _Fail, data: Mapping[str, Any], field_name: str) -> bool:
    value = data.get(field_name, False)
    if not isinstance(value, bool):
        raise fail(field_name, f"must be a boolean, got {value!r}")
    return value


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_ALPHA_RULE = (
    f"a positive number in float32's normal range [{FLOAT32_TINY!r}, {FLOAT32_MAX!r}] (the scaling "
    "alpha / r is held and applied in float32)"
)


def _float32_alpha(value: object) -> bool:
    """Whether ``value`` is an alpha whose scaling float32 can hold: positive (zero makes the adapter the
    base model, a negative value inverts it), at most float32's largest value (``1e39 / r`` is inf in
    float32 for small r, and so is every logit), and not below its smallest normal one."""
    # Compared, never converted: an int too large for a float fails the bound instead of raising, and
    # NaN and the infinities fail it too.
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and FLOAT32_TINY <= value <= FLOAT32_MAX
    )
