"""``adapter_config.json``: the fields lora_pin serves, the ones it refuses, and PEFT's matching rules.

Matching follows PEFT 0.21 exactly (``peft/utils/other.py`` and ``peft/tuners/tuners_utils.py``):

* ``target_modules`` as a string is a regex that must ``re.fullmatch`` the module key; as a list, a key
  matches when it equals an entry or ends with ``"." + entry``. ``layers_to_transform`` (and
  ``layers_pattern``) only apply to the list form; PEFT refuses them with a string.
* ``rank_pattern`` / ``alpha_pattern``: the first key (in file order) for which
  ``re.match(rf"(.*\\.)?({key})$", module_key)`` succeeds gives the value; otherwise ``r`` / ``lora_alpha``.
* scaling is ``alpha / sqrt(r)`` with ``use_rslora``, else ``alpha / r``, with the module's own r and alpha.

Stricter than PEFT where PEFT's leniency serves wrong output silently: ``lora_alpha`` (PEFT's default 8 when
the key is absent, as PEFT itself loads such a file) and every ``alpha_pattern`` value must be positive and
finite (zero turns the adapter into the base model, a negative value inverts it; ``null`` or a string is
what a broken export looks like). Ranks above :data:`~lora_pin.weights.limits.MAX_ADAPTER_RANK` and
config files above :data:`~lora_pin.weights.limits.MAX_CONFIG_BYTES` are refused before anything is sized
from them.

Module keys are relative to the base model, e.g. ``model.layers.0.self_attn.q_proj``.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from lora_pin.errors import AdapterLoadError
from lora_pin.weights.limits import MAX_ADAPTER_RANK, MAX_CONFIG_BYTES, check_file_size
from lora_pin.weights.patterns import regex_refusal

__all__ = ["AdapterConfig", "layer_index", "read_adapter_config"]

# PEFT's default layer-index rule: the first numbered segment after at least two name segments.
_LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


def layer_index(module_key: str, layers_pattern: tuple[str, ...] = ()) -> int | None:
    """The decoder layer index in ``module_key`` by PEFT's rule, or None when it has none."""
    if not layers_pattern:
        match = _LAYER_INDEX.match(module_key)
    else:
        match = None
        for pattern in layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module_key)
            if match is not None:
                break
    return None if match is None else int(match.group("idx"))


def _pattern_value(patterns: Mapping[str, float], module_key: str) -> float | None:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return None


# init_lora_weights values whose PEFT initialisation also rewrites the base layer's weight (PiSSA and its
# pissa_niter_N form, OLoRA, CorDA, LoftQ, LoRA-GA).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True)
class AdapterConfig:
    """The servable part of a PEFT LoRA ``adapter_config.json``.

    ``target_modules`` is a tuple of names or one regex string; ``layers_to_transform`` None means all
    layers. Build it with :func:`read_adapter_config` (or :meth:`from_mapping`), which refuses what lora_pin
    cannot serve.
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

    @classmethod
    def from_mapping(cls, name: str, file: str, data: Mapping[str, Any]) -> AdapterConfig:
        """Validate a parsed ``adapter_config.json`` and keep the fields that matter.

        Raises:
            AdapterLoadError: naming the adapter, the file and the field, for ``peft_type`` other than LORA,
                ``use_dora``, ``bias`` other than "none", non-empty ``modules_to_save``, ``lora_bias``,
                ``target_parameters``, ``trainable_token_indices``, ``layer_replication``, ``use_qalora``,
                ``alora_invocation_tokens``, and for any field of the wrong type or value.
        """

        def fail(field_name: str, why: str) -> AdapterLoadError:
            return AdapterLoadError(f"adapter {name!r} ({file}): field {field_name!r} {why}")

        def check_regex(field_name: str, shown: str, *patterns: str) -> None:
            # Each pattern as written and as it is matched (embedded in a larger one).
            why = next(filter(None, map(regex_refusal, patterns)), None)
            if why:
                raise fail(field_name, f"{shown} {why}")

        if not isinstance(data, Mapping):
            raise AdapterLoadError(
                f"adapter {name!r} ({file}): expected a JSON object, got {type(data).__name__}"
            )
        peft_type = data.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise fail("peft_type", f"is {peft_type!r}; only LORA adapters can be served")
        if data.get("use_dora"):
            raise fail("use_dora", "is true; DoRA rescales the base weight per column and cannot be served")
        bias = data.get("bias", "none")
        if bias != "none":
            raise fail("bias", f"is {bias!r}; adapters that train biases cannot be served (must be 'none')")
        if data.get("modules_to_save"):
            raise fail(
                "modules_to_save",
                f"is {data['modules_to_save']!r}; adapters that replace whole modules cannot be served",
            )
        unsupported = {
            "lora_bias": "adds a bias to lora_B",
            "target_parameters": "targets raw parameters instead of linear modules",
            "trainable_token_indices": "trains embedding rows",
            "layer_replication": "changes the base model's layer stack",
            "use_qalora": "pools the input before lora_A",
            "alora_invocation_tokens": "activates the adapter by token position",
        }
        for key, why in unsupported.items():
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

        r = data.get("r", 8)
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise fail("r", f"must be a positive integer, got {r!r}")
        if r > MAX_ADAPTER_RANK:
            raise fail("r", f"is {r}, above the limit MAX_ADAPTER_RANK={MAX_ADAPTER_RANK}")
        alpha = data.get("lora_alpha", 8)
        if not _positive_finite(alpha):
            raise fail("lora_alpha", f"must be a positive finite number, got {alpha!r}")

        rank_pattern = data.get("rank_pattern") or {}
        alpha_pattern = data.get("alpha_pattern") or {}
        for key, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
            if not isinstance(pattern, Mapping):
                raise fail(key, f"must be an object, got {pattern!r}")
            for pattern_key, value in pattern.items():
                is_rank = key == "rank_pattern"
                if is_rank:
                    bad = isinstance(value, bool) or not isinstance(value, int) or value <= 0
                    kind = "integer"
                else:
                    bad = not _positive_finite(value)
                    kind = "finite number"
                if bad:
                    raise fail(key, f"entry {pattern_key!r} must be a positive {kind}, got {value!r}")
                if is_rank and value > MAX_ADAPTER_RANK:
                    raise fail(
                        key,
                        f"entry {pattern_key!r} is {value}, above the limit "
                        f"MAX_ADAPTER_RANK={MAX_ADAPTER_RANK}",
                    )
                if not isinstance(pattern_key, str):
                    raise fail(key, f"key {pattern_key!r} must be a string")
                check_regex(key, f"key {pattern_key!r}", pattern_key, rf"(.*\.)?({pattern_key})$")

        raw_targets = data.get("target_modules")
        if isinstance(raw_targets, str):
            check_regex("target_modules", repr(raw_targets), raw_targets)
            targets: tuple[str, ...] | str = raw_targets
        elif isinstance(raw_targets, list) and raw_targets and all(isinstance(t, str) for t in raw_targets):
            targets = tuple(raw_targets)
        else:
            raise fail(
                "target_modules", f"must be a regex string or a non-empty list of names, got {raw_targets!r}"
            )

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
        if not isinstance(layers_pattern, (list, tuple)) or not all(
            isinstance(p, str) for p in layers_pattern
        ):
            raise fail("layers_pattern", f"must be a string or a list of strings, got {layers_pattern!r}")
        for pattern in layers_pattern:
            check_regex("layers_pattern", repr(pattern), pattern, rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.")
        if isinstance(targets, str) and (layers or layers_pattern):
            raise fail(
                "layers_to_transform", "cannot be used when target_modules is a regex string (PEFT rule)"
            )

        exclude = data.get("exclude_modules") or ()
        if isinstance(exclude, str):
            check_regex("exclude_modules", repr(exclude), exclude)
        elif isinstance(exclude, (list, tuple)) and all(isinstance(m, str) for m in exclude):
            exclude = tuple(exclude)
        else:
            raise fail("exclude_modules", f"must be a regex string or a list of names, got {exclude!r}")
        fan_in_fan_out = data.get("fan_in_fan_out", False)
        if not isinstance(fan_in_fan_out, bool):
            raise fail("fan_in_fan_out", f"must be a boolean, got {fan_in_fan_out!r}")
        use_rslora = data.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise fail("use_rslora", f"must be a boolean, got {use_rslora!r}")

        return cls(
            name=name,
            file=file,
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets,
            use_rslora=use_rslora,
            rank_pattern=dict(rank_pattern),
            alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
            layers_to_transform=None if not layers else tuple(layers),
            layers_pattern=tuple(layers_pattern),
            exclude_modules=exclude,
            fan_in_fan_out=fan_in_fan_out,
            base_model_name_or_path=data.get("base_model_name_or_path"),
        )

    def rank_for(self, module_key: str) -> int:
        """The rank PEFT gives ``module_key``: its ``rank_pattern`` entry, else ``r``."""
        value = _pattern_value(self.rank_pattern, module_key)
        return self.r if value is None else int(value)

    def alpha_for(self, module_key: str) -> float:
        """The alpha PEFT gives ``module_key``: its ``alpha_pattern`` entry, else ``lora_alpha``."""
        value = _pattern_value(self.alpha_pattern, module_key)
        return self.lora_alpha if value is None else float(value)

    def scaling_for(self, module_key: str, rank: int) -> float:
        """``alpha / sqrt(rank)`` with rslora, else ``alpha / rank``, with ``module_key``'s own alpha."""
        alpha = self.alpha_for(module_key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, module_key: str) -> bool:
        """Whether PEFT would put this adapter's LoRA on ``module_key`` (exclusions and layers included)."""
        exclude = self.exclude_modules
        if isinstance(exclude, str):
            if exclude and re.fullmatch(exclude, module_key):
                return False
        elif module_key in exclude or any(module_key.endswith(f".{e}") for e in exclude):
            return False
        if isinstance(self.target_modules, str):
            return (
                self.target_modules == "all-linear"
                or re.fullmatch(self.target_modules, module_key) is not None
            )
        if module_key in self.target_modules:
            return True
        if not any(module_key.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        index = layer_index(module_key, self.layers_pattern)
        return index is not None and index in self.layers_to_transform


def _positive_finite(value: object) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, int | float) and value > 0 and math.isfinite(value)
    )


def read_adapter_config(name: str, directory: Path) -> AdapterConfig:
    """Read and validate ``directory / "adapter_config.json"`` with orjson.

    Raises:
        AdapterLoadError: the file is missing, unreadable, larger than
            :data:`~lora_pin.weights.limits.MAX_CONFIG_BYTES` or not JSON, or a field is refused (see
            :meth:`AdapterConfig.from_mapping`); the message names the adapter and the file.
    """
    path = directory / "adapter_config.json"
    if not os.path.lexists(path):
        raise AdapterLoadError(f"adapter {name!r}: {path} does not exist; not a PEFT adapter directory")
    check_file_size(name, path, MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES")
    try:
        # Non-blocking, and checked again on the open file: swapped for a FIFO since the check above,
        # it is refused instead of blocking the loading thread.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise AdapterLoadError(f"adapter {name!r} ({path}): not a regular file")
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise AdapterLoadError(f"adapter {name!r} ({path}): cannot read the config: {exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        # The file grew after it was measured: still never read more than the limit.
        raise AdapterLoadError(
            f"adapter {name!r} ({path}): file is above the limit MAX_CONFIG_BYTES={MAX_CONFIG_BYTES}"
        )
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise AdapterLoadError(f"adapter {name!r} ({path}): not valid JSON: {exc}") from None
    return AdapterConfig.from_mapping(name, str(path), data)
