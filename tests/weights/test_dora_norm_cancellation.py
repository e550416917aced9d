"""DoRA's norm ``||W + s B A||`` on rows that are tiny against ``W``: factors, served rows, a zero refused.

:func:`lora_pin.fixtures.make_cancelling_dora` makes rows of ``W + s B A`` at 1, 1e-2, 1e-3, 1e-4 and
1e-6 of ``||W||`` in layer 0's ``down_proj`` of the tiny Llama (and, in a second adapter, one exactly
zero), from values that are exact in float32 and bfloat16. The norm expanded as
``||W||^2 + 2 s <W, B A> + s^2 ||B A||^2`` loses such rows to rounding of terms a 1e12 times larger than
their sum; formed row by row, they keep their digits. Oracles: the factor ``m / ||W + s B A||`` in float64
from the file's tensors and the model's weight, and PEFT's forward of the same model and adapter (with a
bfloat16 model PEFT keeps the adapter in float32, its default, and computes the norm in float32).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError
from lora_pin.fixtures import CANCEL_MODULE, CANCEL_RATIOS, ZERO_FEATURE, make_cancelling_dora
from lora_pin.model.attach import base_weights, model_targets
from lora_pin.weights.host_tier import load_adapter

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]
# A served DoRA feature's largest error over the tokens, relative to its own largest output. float32: the
# factor, the rescale and PEFT's sum each round once (2^-24) on values computed alike (A x is exactly 0,
# W x the same base layer's), so 1e-5 leaves room only for a norm accurate to its result. bfloat16 (unit
# roundoff 2^-8): PEFT rounds its float32 result once, lora_pin the factor in the slot and the rescaled
# output, and the two base outputs W x, rounded from two GEMM calls, may sit an ulp (2^-7) apart: 5 * 2^-8
# (7.5e-3 measured; the norm expanded as before is off by 4% at 1e-3 and refuses the 1e-4 row).
FEATURE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 5 * 2**-8}
# Logits, per token, relative to that token's largest logit (bfloat16: what tests/model/test_dora_serving.py
# allows, the layers after this one in bfloat16).
LOGITS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 6e-2}


@pytest.fixture(scope="module")
def cancelling(
    tiny_llama: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory
) -> tuple[torch.nn.Module, dict[str, Path]]:
    """The tiny Llama edited by :func:`make_cancelling_dora` and its ``cancel`` and ``zero`` adapters."""
    base = copy.deepcopy(tiny_llama).eval()
    return base, make_cancelling_dora(base, tmp_path_factory.mktemp("cancelling"))


def _exact_rows(model: torch.nn.Module, path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``[out]`` per output feature of the cancelling module: ``m``, ``||W + s B A||``, ``||W||``."""
    state = load_file(str(path / "adapter_model.safetensors"))
    prefix = f"base_model.model.{CANCEL_MODULE}"
    a, b = state[f"{prefix}.lora_A.weight"].double(), state[f"{prefix}.lora_B.weight"].double()
    weight = model.get_submodule(CANCEL_MODULE).weight.detach().double()
    norms = torch.linalg.vector_norm(weight + 2 * b @ a, dim=1)
    return state[f"{prefix}.lora_magnitude_vector"].double(), norms, torch.linalg.vector_norm(weight, dim=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_factors_exact_where_rows_cancel(
    cancelling: tuple[torch.nn.Module, dict[str, Path]], dtype: torch.dtype
) -> None:
    base, adapters = cancelling
    model = copy.deepcopy(base).to(dtype)
    targets, module_of = model_targets(model, None)
    adapter = load_adapter(
        "cancel",
        adapters["cancel"],
        targets,
        max_rank=4,
        dtype=dtype,
        base_weights=base_weights(model, targets, module_of),
    )
    magnitude, norms, weight_norms = _exact_rows(model, adapters["cancel"])
    rows = list(CANCEL_RATIOS)
    torch.testing.assert_close(
        (norms / weight_norms)[rows],
        torch.tensor(list(CANCEL_RATIOS.values()), dtype=torch.float64),
        rtol=1e-2,
        atol=0,
    )
    factor = adapter.modules[CANCEL_MODULE].factor
    assert factor is not None
    # The float64 value rounded once to float32.
    torch.testing.assert_close(factor.double(), magnitude / norms, rtol=2**-23, atol=0)


def _layer_and_logits(
    model: torch.nn.Module, module: torch.nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s logits for ``ids`` and what ``module`` returned in that forward."""
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0], logits


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_served_rows_equal_peft_where_rows_cancel(
    cancelling: tuple[torch.nn.Module, dict[str, Path]], dtype: torch.dtype
) -> None:
    """Every output feature of the cancelling layer, and every token's logits, against PEFT's forward."""
    from peft import PeftModel

    base, adapters = cancelling
    base = copy.deepcopy(base).to(dtype)
    ids = torch.randint(1, 128, (3, 6), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters["cancel"])).eval()
    want_layer, want = _layer_and_logits(peft, peft.base_model.model.get_submodule(CANCEL_MODULE), ids)
    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"cancel={adapters['cancel']}"], max_loras_per_batch=1)
    with mgr.batch(["cancel"] * ids.shape[0]):
        got_layer, got = _layer_and_logits(model, model.get_submodule(CANCEL_MODULE), ids)
    rtol = FEATURE_RTOL[dtype]
    errors = (got_layer.double() - want_layer.double()).abs().flatten(0, -2).amax(dim=0)
    scales = want_layer.double().abs().flatten(0, -2).amax(dim=0)
    # Feature ZERO_FEATURE of this adapter is W's own row, zero on the odd columns: its output is 0 in both.
    assert int((scales == 0).sum()) == 1
    for feature in range(errors.shape[0]):
        assert errors[feature] <= rtol * scales[feature], (
            f"feature {feature} (ratio {CANCEL_RATIOS.get(feature, '-')}): "
            f"error {float(errors[feature]):.3g} of {float(scales[feature]):.3g}"
        )
    logit_errors = (got.double() - want.double()).abs().amax(dim=-1)
    assert bool((logit_errors <= LOGITS_RTOL[dtype] * want.double().abs().amax(dim=-1)).all()), logit_errors


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_exact_zero_row_refused_by_name_and_nothing_changes(
    cancelling: tuple[torch.nn.Module, dict[str, Path]], dtype: torch.dtype
) -> None:
    """The ``zero`` adapter's row of ``W + s B A`` is exactly zero (PEFT would divide by it): its load is
    refused naming the adapter, the module and the output feature, and the manager holds and serves what
    it did before."""
    base, adapters = cancelling
    model = copy.deepcopy(base).to(dtype)
    mgr = LoRAManager(model, [f"cancel={adapters['cancel']}"], max_loras_per_batch=2)
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(1))

    def serve() -> torch.Tensor:
        with torch.no_grad(), mgr.batch(["cancel", None]):
            return model(input_ids=ids).logits

    before = (serve(), list(mgr.host), mgr.host.nbytes, mgr.registry.placement())
    with pytest.raises(
        AdapterLoadError,
        match=rf"adapter 'zero' .*module '{CANCEL_MODULE}'.* output feature {ZERO_FEATURE}: .*zero",
    ):
        mgr.load("zero", adapters["zero"])
    assert "zero" not in mgr.registry
    after = (serve(), list(mgr.host), mgr.host.nbytes, mgr.registry.placement())
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_norms_keep_the_digits_of_the_row_not_of_w(dtype: torch.dtype) -> None:
    """Values that no float32 sum resolves (an rsLoRA scaling, normal A and B, ``W = -s B A`` rounded to
    its dtype plus a residual down to 1e-6 of it): each norm within 1e-8 of its float64 value, where a
    float32 ``W + s B A`` (PEFT's) is off by up to 6e-8 of ``||W||``, a tenth of these rows' norms. The
    parts of two column shards add up to the whole rows' (a row-parallel layer's all-reduce)."""
    from lora_pin.weights.dora import dora_norm_parts

    gen = torch.Generator().manual_seed(3)
    rank, scaling = 8, 16 / 8**0.5
    a, b = torch.randn(rank, 256, generator=gen), torch.randn(64, rank, generator=gen)
    delta = scaling * b.double() @ a.double()
    ratios = torch.tensor([1.0, 1e-2, 1e-4, 1e-6], dtype=torch.float64).repeat(16)
    residual = torch.randn(64, 256, generator=gen, dtype=torch.float64)
    residual *= (ratios * delta.norm(dim=1) / residual.norm(dim=1))[:, None]
    weight = (residual - delta).to(dtype)
    slices = [(0, 64, rank, scaling)]
    want = torch.linalg.vector_norm(weight.double() + delta, dim=1)
    parts = dora_norm_parts(weight, a, b, slices)
    assert parts.dtype == torch.float64 and parts.shape == (2, 64)
    torch.testing.assert_close(parts[0].sqrt(), want, rtol=1e-8, atol=0)
    assert bool((parts[1] < 1e-12 * parts[0]).all())  # every row far above its rounding bound
    halves = [
        dora_norm_parts(weight[:, cols], a[:, cols], b, slices) for cols in (slice(0, 100), slice(100, 256))
    ]
    torch.testing.assert_close(halves[0][0] + halves[1][0], parts[0], rtol=1e-9, atol=0)


def test_checked_factor_refuses_a_norm_within_rounding_and_a_factor_out_of_range(
    tiny_llama: torch.nn.Module,
) -> None:
    """The rule on its own: a norm at most its rounding bound is zero; a factor that float16 cannot hold
    is refused for a float16 slot and served in float32."""
    from lora_pin.weights.dora import checked_factor

    targets, _ = model_targets(copy.deepcopy(tiny_llama), None)
    group = next(g for g in targets.groups if g.key == CANCEL_MODULE)
    slices = [(0, 64, 4, 2.0)]
    magnitude = torch.ones(64)
    parts = torch.ones(2, 64, dtype=torch.float64)
    parts[1] = 0
    parts[:, 7] = torch.tensor([1e-30, 1e-30])
    with pytest.raises(
        AdapterLoadError, match=rf"^here: module '{CANCEL_MODULE}': output feature 7: .* is zero"
    ):
        checked_factor("here", group, parts, magnitude, slices, torch.float32)
    parts[1, 7] = 0.99e-30
    assert float(checked_factor("here", group, parts, magnitude, slices, torch.float32)[7]) == pytest.approx(
        1e15
    )
    with pytest.raises(
        AdapterLoadError,
        match=rf"module '{CANCEL_MODULE}': output feature 7: .* out of torch.float16's range",
    ):
        checked_factor("here", group, parts, magnitude, slices, torch.float16)
