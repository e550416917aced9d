"""LoRA on MoE experts: finding a model's fused expert weights and the wrapper that serves them.

Transformers 5 keeps a MoE layer's experts in one module holding 3-D weights, ``gate_up_proj``
``[E, 2 * I, H]`` and ``down_proj`` ``[E, H, I]`` (``[E, in, out]`` when the class is marked
``is_transposed``), called as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.
PEFT puts LoRA on them with ``target_parameters``; :class:`LoRAExperts` serves such adapters, every
request its own, by computing the routed rows of the tokens that use an adapter itself (base projection,
then the expert LoRA delta of :mod:`lora_pin.ops.experts`, for ``gate_up_proj`` before the gate and for
``down_proj`` before the routing weight).

Base rows: when a step has tokens without an adapter, the wrapped module's own forward runs over the whole
batch first and only the adapter tokens' rows are replaced, so base rows are bit-identical to the base
model run on the same batch (whatever experts implementation the model is configured with). Only the
layouts transformers' default experts forward computes are served: gated (``act_fn(gate) * up`` through
the class's ``_apply_gate``), concatenated ``gate_up_proj``, no biases, no post-expert norm. Other
expert modules (gpt-oss's interleaved, biased experts, say) are refused with the reason.

Llama 4's experts are "dense": called as ``experts(hidden_states [E * T, H])``, every token's row once per
expert, already scaled by its routing weight (zero for experts not chosen), with ``gate_up_proj``
``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` multiplied from the right (``bmm(x, W)``). The module's own
forward computes every row; the adapter tokens' rows are then recomputed with their expert LoRA in every
expert's block. PEFT, seeing no ``is_transposed``, reads those weights the other way round, so their
adapter files hold the factors with their roles swapped (see ``LinearTarget.peft_swapped``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lora_pin.errors import OpArgumentError
from lora_pin.model.layers import BaseLayerWrapper
from lora_pin.model.segments import StepSegments
from lora_pin.ops import KernelMeta
from lora_pin.ops.backends import LoRABackend, backend_for
from lora_pin.ops.experts import expert_segments
from lora_pin.weights.pool import GroupBuffers

__all__ = ["EXPERT_PARAMETERS", "ExpertLayout", "LoRAExperts", "expert_layout"]

#: The expert weights lora_pin serves, in the order the experts forward applies them.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertLayout:
    """A servable experts module: ``num_experts``, each served parameter's per-expert
    ``(in_features, out_features)`` by name, and whether its weights are stored ``[E, in, out]``."""

    num_experts: int
    features: Mapping[str, tuple[int, int]]
    transposed: bool
    #: Called as ``experts(hidden_states [E * T, H])`` with every token's row once per expert, already
    #: scaled by its routing weight (Llama 4), instead of with ``top_k_index`` and ``top_k_weights``.
    dense: bool = False
    #: PEFT reads the weights the other way round than the forward uses them (see
    #: :attr:`~lora_pin.weights.targets.LinearTarget.peft_swapped`).
    peft_swapped: bool = False


def _three_d_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}


def expert_layout(module: torch.nn.Module) -> ExpertLayout | str | None:
    """How lora_pin serves ``module``'s expert weights: None when it holds no 3-D parameter of its own (no
    experts module), a string saying why not when it is one lora_pin cannot serve, else its layout."""
    params = _three_d_parameters(module)
    if not params:
        return None
    kind = type(module).__name__
    missing = [n for n in EXPERT_PARAMETERS if n not in params]
    if missing:
        return (
            f"{kind} holds 3-D weights {sorted(params)} but not {missing}: lora_pin serves expert LoRA on "
            "gated experts with a concatenated gate_up_proj and a down_proj"
        )
    unsupported = {
        "has_bias": (True, "its experts add biases"),
        "is_concatenated": (False, "its gate_up_proj interleaves gate and up rows"),
        "has_gate": (False, "its experts have no gate"),
        "has_post_expert_norm": (True, "it normalises each expert's output"),
    }
    for attribute, (bad, why) in unsupported.items():
        if getattr(module, attribute, not bad) == bad:
            return f"{kind}: {why}, which lora_pin's expert LoRA does not compute"
    if not callable(getattr(module, "_apply_gate", None)) and not callable(getattr(module, "act_fn", None)):
        return f"{kind} has no act_fn or _apply_gate: lora_pin cannot compute its gate"
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    dense = _takes_hidden_states_only(module)
    # A dense experts module multiplies by its weights (``bmm(x, W)``): they are [E, in, out], though it is
    # not marked is_transposed, so PEFT takes them for [E, out, in].
    marked = bool(getattr(module, "is_transposed", False))
    transposed = marked or dense
    # Per expert, as PEFT reads them: [out, in], or [in, out] when transposed.
    gu_out, gu_in = gate_up.shape[1:] if not transposed else gate_up.shape[:0:-1]
    d_out, d_in = down.shape[1:] if not transposed else down.shape[:0:-1]
    if gate_up.shape[0] != down.shape[0] or gu_out != 2 * d_in or d_out != gu_in:
        return (
            f"{kind}: gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not the "
            "[E, 2 * I, H] and [E, H, I] of gated experts (or their transposes)"
        )
    features = {"gate_up_proj": (int(gu_in), int(gu_out)), "down_proj": (int(d_in), int(d_out))}
    return ExpertLayout(int(gate_up.shape[0]), features, transposed, dense, transposed and not marked)


def _takes_hidden_states_only(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward takes the hidden states alone (routing applied by its caller)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.kind in positional for p in parameters] == [True]


class LoRAExperts(BaseLayerWrapper):
    """A MoE experts module plus each routed row's expert LoRA delta (see the module docstring).

    Args:
        base_layer: the wrapped experts module (kept as is; its weights are never modified).
        layout: its :class:`ExpertLayout`.
        buffers: the device pool's buffers of the served expert weights, by parameter name
            (``gate_up_proj``, ``down_proj``; either may be absent).
        active_step: returns the active :class:`~lora_pin.model.segments.StepSegments`, or None.
        backend: runs the expert LoRA deltas; the model's layers share one (default: a new one for the
            device of the buffers, :func:`lora_pin.ops.backends.backend_for`).

    Attributes the wrapper does not have itself (``gate_up_proj``, ``num_experts`` ...) are the base
    module's.
    """

    def __init__(
        self,
        base_layer: torch.nn.Module,
        layout: ExpertLayout,
        buffers: Mapping[str, GroupBuffers],
        active_step: Callable[[], StepSegments | None],
        backend: LoRABackend | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self._layout = layout
        self._pool_buffers = dict(buffers)
        self._active_step = active_step
        device = next(iter(self._pool_buffers.values())).a.device
        self._backend = backend_for(device) if backend is None else backend

    def forward(self, hidden_states: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        """``hidden_states [T, H]``, ``top_k_index [T, k]``, ``top_k_weights [T, k]`` -> ``[T, H]``: the
        experts' output, each adapter token's computed with its adapter's expert LoRA. A dense experts
        module (:attr:`ExpertLayout.dense`) takes ``hidden_states [E * T, H]`` alone and returns
        ``[E * T, H]``."""
        if self._layout.dense:
            return self._dense(hidden_states, *routing)
        top_k_index, top_k_weights = routing
        step = self._active_step()
        if step is None or not step.any_adapter:
            return self.base_layer(hidden_states, top_k_index, top_k_weights)
        seg = step.for_input(hidden_states)
        pool_dtype = next(iter(self._pool_buffers.values())).a.dtype
        if hidden_states.dtype != pool_dtype:
            raise OpArgumentError(
                f"{self.extra_repr()}: the input is {hidden_states.dtype} but the adapter pool is "
                f"{pool_dtype}, the model's dtype when the LoRAManager was built"
            )
        counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
        token_slots = torch.repeat_interleave(seg.seg_slots.long(), counts, output_size=seg.perm.shape[0])
        # Tokens of a skipped segment (slot -1), and those whose adapter has no expert LoRA here (one on
        # attention only), take the base forward, which keeps them exact.
        with_experts = torch.stack([(b.ranks > 0).any(dim=1) for b in self._pool_buffers.values()]).any(0)
        served = (token_slots >= 0) & with_experts[token_slots.clamp_min(0)]
        tokens, slots = seg.perm[served], token_slots[served]
        n_tokens = hidden_states.shape[0]
        if tokens.shape[0] < n_tokens:
            result = self.base_layer(hidden_states, top_k_index, top_k_weights)
        else:
            result = torch.zeros_like(hidden_states)
        if tokens.numel():
            adapted = self._adapter_rows(hidden_states, top_k_index, top_k_weights, tokens, slots, step)
            result.index_copy_(0, tokens, adapted.to(result.dtype))
        return result

    def _dense(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[E * T, H]`` (expert e's block of rows is every token, scaled by its routing weight) ->
        ``[E * T, H]``: the module's own output, with each adapter token's rows in every block computed
        with its adapter's expert LoRA."""
        result = self.base_layer(hidden_states)
        step = self._active_step()
        if step is None or not step.any_adapter:
            return result
        self._check_input_dtype(hidden_states)
        n_experts = self._layout.num_experts
        width = hidden_states.shape[-1]
        n_tokens = hidden_states.shape[0] // n_experts
        tokens, slots = self._adapter_tokens(step.for_input(hidden_states[:n_tokens]), n_tokens)
        if not tokens.numel():
            return result
        x = hidden_states.view(n_experts, n_tokens, width).index_select(1, tokens)  # [E, N, H]
        base = self.base_layer
        gate_up = torch.bmm(x, base.gate_up_proj) + self._dense_delta("gate_up_proj", x, slots)
        gate = getattr(base, "_apply_gate", None)
        h = gate(gate_up) if callable(gate) else _default_gate(base, gate_up)
        out = torch.bmm(h, base.down_proj) + self._dense_delta("down_proj", h, slots)
        result.view(n_experts, n_tokens, width).index_copy_(1, tokens, out.to(result.dtype))
        return result

    def _adapter_tokens(self, seg: KernelMeta, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens (int64 ``[N]``) whose adapter has expert LoRA here, and their slots (``[N]``)."""
        counts = (seg.seg_indptr[1:] - seg.seg_indptr[:-1]).long()
        in_order = torch.repeat_interleave(seg.seg_slots.long(), counts, output_size=seg.perm.shape[0])
        slot_of = torch.full((n_tokens,), -1, dtype=torch.long, device=in_order.device)
        slot_of[seg.perm.long()] = in_order
        with_experts = torch.stack([(b.ranks > 0).any(dim=1) for b in self._pool_buffers.values()]).any(0)
        served = (slot_of >= 0) & with_experts[slot_of.clamp_min(0)]
        tokens = served.nonzero().squeeze(1)
        return tokens, slot_of[tokens]

    def _dense_delta(self, name: str, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | float:
        """``x [E, N, in]``'s expert LoRA delta on weight ``name``, each token with its slot's adapter:
        ``[E, N, out]`` (0 when no adapter here has LoRA on ``name``)."""
        buffers = self._pool_buffers.get(name)
        if buffers is None:
            return 0.0
        return self._backend.dense_expert_lora(buffers, x, slots, self._layout.features[name][1])

    def _check_input_dtype(self, hidden_states: torch.Tensor) -> None:
        """Raises OpArgumentError when ``hidden_states`` is not in the pool's dtype."""
        pool_dtype = next(iter(self._pool_buffers.values())).a.dtype
        if hidden_states.dtype != pool_dtype:
            raise OpArgumentError(
                f"{self.extra_repr()}: the input is {hidden_states.dtype} but the adapter pool is "
                f"{pool_dtype}, the model's dtype when the LoRAManager was built"
            )

    def _adapter_rows(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, k]
        top_k_weights: torch.Tensor,  # [T, k]
        tokens: torch.Tensor,  # int64 [N], the adapter tokens
        slots: torch.Tensor,  # int64 [N], their slots
        step: StepSegments,
    ) -> torch.Tensor:
        """The experts' output ``[N, H]`` for ``tokens``, with each token's adapter."""
        layout, base = self._layout, self.base_layer
        n_experts, top_k = layout.num_experts, top_k_index.shape[1]
        row_experts = top_k_index.index_select(0, tokens).reshape(-1)
        row_slots = slots.repeat_interleave(top_k)
        # A row routed to an expert this rank does not hold (an expert-parallel sentinel) adds nothing,
        # as in transformers: no GEMM and no delta reach it.
        held = (row_experts >= 0) & (row_experts < n_experts)
        # The rows are laid out sorted by (slot, expert) from the start, so every (adapter, expert)
        # segment is a run of consecutive rows: the ops then work on views, with no gather or scatter.
        by_pair = torch.argsort(torch.where(held, row_slots * n_experts + row_experts, -1), stable=True)
        row_experts, row_slots, held = row_experts[by_pair], row_slots[by_pair], held[by_pair]
        row_tokens = torch.div(by_pair, top_k, rounding_mode="floor")  # [N * k] into tokens
        row_weights = top_k_weights.index_select(0, tokens).reshape(-1)[by_pair].unsqueeze(1)
        x = hidden_states.index_select(0, tokens.index_select(0, row_tokens))  # [N * k, H]
        segments = expert_segments(row_slots, row_experts, n_experts, step.chunk_size)
        keyed = torch.where(held, row_experts, n_experts)
        # The base projections, one GEMM per expert hit, as transformers' eager experts forward does.
        order = torch.argsort(keyed, stable=True)
        hits = torch.bincount(keyed, minlength=n_experts + 1)
        bounds = [0, *torch.cumsum(hits, 0).tolist()]
        groups = [
            (e, order[bounds[e] : bounds[e + 1]]) for e in range(n_experts) if bounds[e + 1] > bounds[e]
        ]
        gate_up = self._project(x, "gate_up_proj", groups, segments)
        gate = getattr(base, "_apply_gate", None)
        h = gate(gate_up) if callable(gate) else _default_gate(base, gate_up)
        out = self._project(h, "down_proj", groups, segments) * row_weights
        out = out * held.unsqueeze(1).to(out.dtype)
        return out.new_zeros((tokens.shape[0], out.shape[1])).index_add_(0, row_tokens, out)

    def _project(
        self,
        x: torch.Tensor,  # [R, in]
        name: str,
        groups: list[tuple[int, torch.Tensor]],
        segments: KernelMeta,
    ) -> torch.Tensor:
        """``x`` ``[R, in]`` through each row's expert's ``name`` weight, plus the row's expert LoRA
        delta: ``[R, out]``."""
        weight = getattr(self.base_layer, name)
        out = x.new_zeros((x.shape[0], self._layout.features[name][1]))
        for expert, rows in groups:
            w = weight[expert]
            rows_x = x.index_select(0, rows)
            out.index_copy_(0, rows, rows_x @ w if self._layout.transposed else F.linear(rows_x, w))
        buffers = self._pool_buffers.get(name)
        if buffers is not None:
            self._backend.add_expert_lora(buffers, out, x, segments)
        return out

    def extra_repr(self) -> str:
        served = ", ".join(sorted(self._pool_buffers))
        return f"experts={self._layout.num_experts}, lora on [{served}]"


def _default_gate(module: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    act_fn = module.act_fn
    assert callable(act_fn)
    return act_fn(gate) * up
