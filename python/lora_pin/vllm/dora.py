"""DoRA adapters served by vLLM through the plugin (vLLM 0.32 refuses PEFT's ``use_dora`` at load).

A DoRA linear's output is the plain LoRA output rescaled per output feature around the bias,
``y = f * (base(x) - bias + s B A x) + bias`` with ``f = m / ||W + s B A||`` (:mod:`lora_pin.weights.dora`).
vLLM computes the plain LoRA output already (through lora_pin's punica wrapper); this module adds the
rest, with lora_pin's own DoRA code:

- **Base weights**: vLLM's CPU path packs each linear layer's weight for its GEMM and drops the plain
  ``[out, in]`` one, which the norms need; with ``LORA_PIN_VLLM_DORA=1`` (:data:`KEEP_WEIGHTS_ENV`) it
  is kept (the linear weights' memory twice), without it a DoRA adapter is refused, saying so.
- **Load** (vLLM's worker, :func:`install`): vLLM's refusal of ``use_dora`` is lifted, the
  ``lora_magnitude_vector`` tensors are taken out of the adapter's tensors before vLLM parses them (it
  knows only ``lora_A``/``lora_B``), and the factors ``f`` are computed once per loaded adapter and
  module against the layer's base weight (:func:`~lora_pin.weights.dora.dora_norm_parts` and
  :func:`~lora_pin.weights.dora.checked_factor`, as lora_pin's host tier does; a fused q/k/v or gate/up
  layer per slice, from its rows of the fused weight). What lora_pin does not serve is refused here,
  naming the adapter and the module: DoRA on a layer that is not a plain linear (embeddings, the LM
  head), under tensor parallelism or fully sharded LoRA, a module without magnitude, a misshapen or
  non-finite magnitude, a zero norm, a factor out of the serving dtype's range.
- **Activation** (:func:`activate`, called where vLLM puts an adapter into a slot): each linear layer's
  factors for that slot are copied into the layer's factor table (:class:`DoraSlots`), or the slot is
  marked plain in the layers the adapter has no DoRA on.
- **Each layer call** (:meth:`DoraSlots.rescale`, from the punica wrapper's ``add_lora_linear``, after
  the LoRA delta): the step's rows in the layer's DoRA slots are rescaled by
  :func:`lora_pin.ops.dora.scale_rows_`. Base rows and plain LoRA rows are never touched.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_pin.errors import AdapterLoadError
from lora_pin.ops.backends.cpu import rows_in_slots
from lora_pin.ops.dora import scale_rows_
from lora_pin.ops.segments import KernelMeta
from lora_pin.weights.dora import checked_factor, dora_norm_parts
from lora_pin.weights.targets import LinearTarget, TargetGroup

__all__ = ["KEEP_WEIGHTS_ENV", "MAGNITUDE", "DoraSlots", "activate", "dora_factors", "install", "layer_key"]

#: The last segment of a DoRA magnitude's tensor name in a PEFT adapter file.
MAGNITUDE = "lora_magnitude_vector"


#: The environment variable that makes vLLM's CPU path keep each linear layer's plain base weight
#: (``"1"``), which DoRA's norms need: it packs the weight for its GEMM and drops the plain one.
KEEP_WEIGHTS_ENV = "LORA_PIN_VLLM_DORA"


def install() -> None:
    """Patches vLLM's LoRA loading in this process (from :func:`lora_pin.vllm.seams.install`, once), and
    its CPU weight packing when :data:`KEEP_WEIGHTS_ENV` is ``"1"``."""
    from vllm.lora import lora_model
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.model_executor.layers import utils as layer_utils

    if os.environ.get(KEEP_WEIGHTS_ENV) == "1":
        layer_utils.dispatch_cpu_unquantized_gemm = _keeping_weight(layer_utils.dispatch_cpu_unquantized_gemm)

    PEFTHelper._validate_features = _allowing_dora(PEFTHelper._validate_features)  # type: ignore[method-assign]
    lora_model.parse_fine_tuned_lora_name = _naming_magnitudes(lora_model.parse_fine_tuned_lora_name)
    from_tensors = lora_model.LoRAModel.from_lora_tensors.__func__  # type: ignore[attr-defined]
    lora_model.LoRAModel.from_lora_tensors = classmethod(_keeping_magnitudes(from_tensors))  # type: ignore[method-assign,assignment]
    WorkerLoRAManager._load_adapter = _with_factors(WorkerLoRAManager._load_adapter)  # type: ignore[method-assign]


def _keeping_weight(dispatch: Any) -> Any:
    """vLLM's ``dispatch_cpu_unquantized_gemm`` that keeps the plain ``[out, in]`` weight it would drop,
    as ``lora_pin_weight`` on the layer (the same storage: the memory of the weight, kept)."""

    @functools.wraps(dispatch)
    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        weight = layer.weight
        if remove_weight and weight.ndim == 2 and not weight.is_meta:
            layer.lora_pin_weight = weight.detach()
        dispatch(layer, remove_weight)

    return dispatch_cpu_unquantized_gemm


def _base_weight(layer: Any) -> torch.Tensor | None:
    """A linear LoRA layer's plain base weight: the one kept by :func:`_keeping_weight`, else the layer's
    own if it is a plain 2-D tensor (vLLM's CPU path leaves an empty one)."""
    base = layer.base_layer
    kept = getattr(base, "lora_pin_weight", None)
    if isinstance(kept, torch.Tensor):
        return kept
    weight = getattr(base, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None


def _is_magnitude(name: str) -> bool:
    # PEFT saves ``...q_proj.lora_magnitude_vector`` (older versions kept a ``.weight`` after it).
    return name.endswith("." + MAGNITUDE) or name.endswith(f".{MAGNITUDE}.weight")


def _allowing_dora(validate: Any) -> Any:
    """``PEFTHelper._validate_features`` that does not count ``use_dora`` among the refused features
    (every other refusal stays vLLM's)."""

    @functools.wraps(validate)
    def _validate_features(self: Any) -> list[str]:
        if not self.use_dora:
            return list(validate(self))
        self.use_dora = False
        try:
            return list(validate(self))
        finally:
            self.use_dora = True

    return _validate_features


def _naming_magnitudes(parse: Any) -> Any:
    """vLLM's ``parse_fine_tuned_lora_name`` that also names a magnitude's module (as its ``lora_B``'s),
    so that vLLM's check of the file's modules against the model's covers DoRA modules too."""

    @functools.wraps(parse)
    def parse_fine_tuned_lora_name(name: str, weights_mapper: Any = None) -> tuple[str, bool]:
        if _is_magnitude(name):
            stem = name.removesuffix(".weight").removesuffix("." + MAGNITUDE)
            return tuple(parse(stem + ".lora_B.weight", weights_mapper))  # type: ignore[return-value]
        return tuple(parse(name, weights_mapper))  # type: ignore[return-value]

    return parse_fine_tuned_lora_name


def _keeping_magnitudes(from_tensors: Any) -> Any:
    """``LoRAModel.from_lora_tensors`` that takes the magnitudes out of the tensors before vLLM parses
    them and keeps them on the model it returns (``lora_pin_magnitudes``: vLLM module name -> float32
    ``[out]``), for :func:`_with_factors`."""
    from vllm.lora import lora_model

    signature = inspect.signature(from_tensors)

    @functools.wraps(from_tensors)
    def from_lora_tensors(cls: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        tensors: dict[str, torch.Tensor] = bound.arguments["tensors"]
        names = [name for name in tensors if _is_magnitude(name)]
        if not names:
            return from_tensors(cls, *args, **kwargs)
        if not bound.arguments["peft_helper"].use_dora:
            raise AdapterLoadError(
                f"tensor {names[0]!r} is a DoRA magnitude, but the adapter's config has no "
                "use_dora: true; refused"
            )
        mapper = bound.arguments.get("weights_mapper")
        bound.arguments["tensors"] = {k: v for k, v in tensors.items() if k not in names}
        model = from_tensors(*bound.args, **bound.kwargs)
        model.lora_pin_magnitudes = {
            lora_model.parse_fine_tuned_lora_name(name, mapper)[0]: tensors[name] for name in names
        }
        return model

    return from_lora_tensors


def _with_factors(load: Any) -> Any:
    """``WorkerLoRAManager._load_adapter`` that computes a DoRA adapter's factors
    (``lora_pin_factors`` on the model it returns: :func:`dora_factors`)."""

    @functools.wraps(load)
    def _load_adapter(self: Any, lora_request: Any) -> Any:
        where = f"adapter {lora_request.lora_name!r} ({lora_request.lora_path})"
        try:
            model = load(self, lora_request)
        except AdapterLoadError as e:
            # Raised by _keeping_magnitudes, which does not know the adapter's name.
            raise AdapterLoadError(f"{where}: {e}") from e
        magnitudes = getattr(model, "lora_pin_magnitudes", None)
        if magnitudes is not None:
            model.lora_pin_factors = dora_factors(where, self._adapter_manager, model.loras, magnitudes)
            del model.lora_pin_magnitudes
        return model

    return _load_adapter


def dora_factors(
    where: str, manager: Any, loras: dict[str, Any], magnitudes: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The DoRA factors of a loaded adapter: vLLM layer name (a fused layer's, for q/k/v or gate/up) ->
    float32 ``[out_total]`` (1 on the rows of slices the adapter has no DoRA on).

    Args:
        where: the adapter, for messages.
        manager: vLLM's ``LoRAModelManager`` (its ``modules``, ``packed_modules`` and ``lora_config``).
        loras: the adapter's ``LoRAModel.loras`` as read (one entry per PEFT module, scaling not yet
            folded into B): module name -> ``LoRALayerWeights`` (``lora_a`` ``[r, in]``, ``lora_b``
            ``[out, r]``, ``scaling``).
        magnitudes: module name -> the module's ``lora_magnitude_vector``.

    Raises:
        AdapterLoadError: naming ``where`` and the module: a module with A and B but no magnitude or a
            magnitude without them; DoRA on a layer that is not a linear with a plain ``[out, in]``
            weight, under tensor parallelism or fully sharded LoRA; a misshapen or non-finite
            magnitude; a zero norm or a factor out of range (:func:`checked_factor`).
    """
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    stray = sorted(set(magnitudes) - set(loras))
    if stray:
        raise AdapterLoadError(
            f"{where}: module {stray[0]!r} has a DoRA magnitude but no lora_A/lora_B; refused"
        )
    if manager.lora_config.fully_sharded_loras:
        raise AdapterLoadError(
            f"{where}: DoRA cannot be served with --fully-sharded-loras (a process would hold only part of "
            "each adapter's rank, and the norms need all of it)"
        )
    # PEFT module -> (the vLLM layer holding it, its slice there).
    located = {
        sub: (packed, s) for packed, subs in manager.packed_modules.items() for s, sub in enumerate(subs)
    }
    factors: dict[str, torch.Tensor] = {}
    for name, weights in loras.items():
        magnitude = magnitudes.get(name)
        if magnitude is None:
            raise AdapterLoadError(
                f"{where}: module {name!r} has no {MAGNITUDE} (a DoRA adapter has one per module); refused"
            )
        layer_name, s = located.get(name, (name, 0))
        layer = manager.modules.get(layer_name)
        if layer is None:
            # vLLM applies nothing to a module this process has no layer for (pipeline stages): nor does DoRA.
            continue
        refused = f"{where}: DoRA on module {name!r} cannot be served"
        if not isinstance(layer, BaseLinearLayerWithLoRA):
            raise AdapterLoadError(
                f"{refused}: its layer is a {type(layer).__name__}; lora_pin serves DoRA on linear layers "
                "only (not on embeddings or the LM head)"
            )
        if layer.tp_size > 1:
            raise AdapterLoadError(f"{refused} under tensor parallelism (--tensor-parallel-size > 1) in vLLM")
        offsets = list(itertools.accumulate(layer.output_slices, initial=0))
        weight = _base_weight(layer)
        if weight is None or tuple(weight.shape) != (offsets[-1], layer.input_size):
            shape = "none" if weight is None else str(list(weight.shape))
            hint = (
                ""
                if os.environ.get(KEEP_WEIGHTS_ENV) == "1"
                else f" (vLLM's CPU path drops it after packing it: start vLLM with {KEEP_WEIGHTS_ENV}=1 to "
                "keep it, which holds the linear layers' weights twice)"
            )
            raise AdapterLoadError(
                f"{refused}: the norm needs the layer's base weight as [{offsets[-1]}, {layer.input_size}], "
                f"and its layer has {shape}{hint}"
            )
        first, last = offsets[s], offsets[s + 1]
        if tuple(magnitude.shape) != (last - first,):
            raise AdapterLoadError(
                f"{where}: module {name!r}: {MAGNITUDE} has shape {list(magnitude.shape)}, expected "
                f"[{last - first}]; refused"
            )
        if not bool(torch.isfinite(magnitude).all()):
            raise AdapterLoadError(f"{where}: module {name!r}: {MAGNITUDE} has NaN/Inf values; refused")
        a, b = weights.lora_a, weights.lora_b
        rank, rows = int(a.shape[0]), last - first
        slices = [(0, rows, rank, float(weights.scaling))]
        with torch.no_grad():
            parts = dora_norm_parts(weight.detach()[first:last], a, b, slices)
        member = LinearTarget(None, name.rpartition(".")[2], name, layer.input_size, rows)
        factor = checked_factor(
            where, TargetGroup(None, member.module, (member,)), parts, magnitude.float(), slices, a.dtype
        )
        factors.setdefault(layer_name, torch.ones(offsets[-1], dtype=torch.float32))[first:last] = factor
    return factors


def activate(manager: Any, slot: int, lora_model: Any) -> None:
    """vLLM has put ``lora_model`` into ``slot``: each linear layer's factor table gets the adapter's
    factors in that slot, or marks the slot plain where the adapter has no DoRA."""
    factors: dict[str, torch.Tensor] = getattr(lora_model, "lora_pin_factors", None) or {}
    for name, layer in manager.modules.items():
        slots = getattr(getattr(layer, "punica_wrapper", None), "dora", None)
        if isinstance(slots, DoraSlots) and hasattr(layer, "lora_a_stacked"):
            slots.set_slot(layer, slot, factors.get(name))


@dataclass
class _Layer:
    """One linear layer's DoRA state: ``factors`` ``[slots, out_total]`` in the layer's LoRA dtype (1 in
    slots without DoRA), the slots holding a DoRA adapter, and the bias the layer adds to the output the
    wrapper rescales (None when it adds it afterwards: ``skip_bias_add``). ``anchor``: the layer's first
    A buffer, whose id is the key the wrapper finds the layer by (kept so the id stays its own)."""

    anchor: torch.Tensor
    factors: torch.Tensor
    bias: torch.Tensor | None
    slots: set[int] = field(default_factory=set)


def layer_key(a: torch.Tensor) -> int:
    """The key of a LoRA layer by its first A buffer (``lora_a_stacked[0]``): where its data lies. vLLM
    allocates a layer's buffers once and copies adapters into them, so the key holds for the model's
    life, in eager calls and in a compiled graph's op calls alike (which get the same buffer, not
    necessarily the same tensor object)."""
    return a.data_ptr()


class DoraSlots:
    """The DoRA state of one punica wrapper's layers (see the module): per layer its factor table, and the
    step's rows in each set of DoRA slots."""

    def __init__(self) -> None:
        self._layers: dict[int, _Layer] = {}
        self._segments: KernelMeta | None = None
        self._rows: dict[frozenset[int], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def set_slot(self, layer: Any, slot: int, factor: torch.Tensor | None) -> None:
        """Puts ``factor`` (float32 ``[out_total]``, None: the adapter in ``slot`` has no DoRA here) into
        the table of vLLM's linear LoRA ``layer``."""
        a = layer.lora_a_stacked[0]
        state = self._layers.get(layer_key(a))
        if factor is None:
            if state is not None:
                state.slots.discard(slot)
            return
        if state is None:
            base = layer.base_layer
            bias = None if getattr(base, "skip_bias_add", False) else getattr(base, "bias", None)
            table = torch.ones(a.shape[0], factor.shape[0], dtype=a.dtype, device=a.device)
            state = self._layers[layer_key(a)] = _Layer(a, table, None if bias is None else bias.detach())
        state.factors[slot].copy_(factor)
        state.slots.add(slot)

    def new_step(self, segments: KernelMeta) -> None:
        """The step's token segments (the wrapper's, made in its ``update_metadata``)."""
        self._segments = segments
        self._rows.clear()

    def rescale(self, out: torch.Tensor, layer: int, add_inputs: bool) -> None:
        """Rescales the DoRA rows of a linear layer's ``out`` ``[T, out_total]`` (base output plus LoRA
        delta) in place; ``layer``: the layer's key (:func:`layer_key`). Every other row is left bit for bit.

        Raises:
            NotImplementedError: DoRA rows in a call whose ``out`` holds only the LoRA delta
                (``add_inputs=False``: vLLM's CUDA dual-stream mode, not the CPU path the plugin serves).
        """
        state = self._layers.get(layer)
        if state is None or not state.slots or self._segments is None:
            return
        key = frozenset(state.slots)
        if key not in self._rows:
            self._rows[key] = rows_in_slots(self._segments, key)
        rows = self._rows[key]
        if rows is None:
            return
        if not add_inputs:
            raise NotImplementedError("DoRA rows need the base output in the call (add_inputs=True)")
        scale_rows_(out, state.bias, state.factors, *rows)
