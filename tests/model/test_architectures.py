"""Architectures whose module names repeat, served against PEFT's mixed-batch forward as the oracle.

Each test builds a tiny model of one family from a config (no download), saves PEFT adapters over it and
checks that ``mgr.batch(names)`` gives PEFT's ``model(..., adapter_names=[...])`` output row for row, and
base rows the base model's own output on the batch bit for bit:

- GPT-2 and StarCoder: ``attn.c_proj`` and ``mlp.c_proj`` in every block (GPT-2's as transformers ``Conv1D``);
- Llava (CLIP + Llama) and Gemma 3 (SigLIP + Gemma 3): a vision tower's ``layers.N.self_attn.q_proj`` beside
  the language model's, adapters on either tower, both, or Llava's projector, random pixels;
- BART and T5: encoder and decoder layers with the same names, each sequence's adapter applied in both
  (encoder inputs ``[B, S]``, decoder inputs ``[B, T]``, cross-attention over the encoder's states);
- Mamba: ``dt_proj`` targeted, whose ``weight`` the mixer reads directly (PEFT refuses ``out_proj`` there);
- Falcon: ``FalconLinear``, an ``nn.Linear`` subclass with its own forward, on every projection.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_pin import LoRAManager
from lora_pin.errors import AdapterLoadError, SpecError
from lora_pin.fixtures import save_peft_adapter

Forward = Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor]


def check_against_peft(
    base: torch.nn.Module,
    adapters: Mapping[str, Path],
    names: list[str | None],
    inputs: dict[str, Any],
    forward: Forward,
) -> LoRAManager:
    """Serve ``names`` (one per sequence) with lora_pin and with PEFT; assert the outputs agree, and the
    base rows equal the plain base model's."""
    from peft import PeftModel

    first, *rest = adapters
    oracle = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters[first]), adapter_name=first)
    for other in rest:
        oracle.load_adapter(str(adapters[other]), adapter_name=other)
    oracle.eval()
    with torch.no_grad():
        want = forward(oracle, {**inputs, "adapter_names": [n or "__base__" for n in names]})
        plain = forward(base, inputs)

    model = copy.deepcopy(base)
    mgr = LoRAManager(model, [f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=len(adapters))
    with torch.no_grad(), mgr.batch(names):
        got = forward(model, inputs)
    for row, name in enumerate(names):
        if name is None:
            # The base model's own output on this batch, bit for bit (PEFT's __base__ rows may differ by
            # an ulp: seen on Mamba).
            assert torch.equal(got[row], plain[row]), f"base row {row} differs from the base model's"
        else:
            assert not torch.allclose(want[row], plain[row], atol=1e-4), f"adapter {name} changes nothing"
        torch.testing.assert_close(got[row], want[row], rtol=1e-4, atol=1e-5, msg=f"row {row} ({name})")
    return mgr


def logits(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).logits


def ids(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build().eval()


# ---------------------------------------------------------------- GPT-2: c_proj twice per block


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=96)
    return seeded(lambda: GPT2LMHeadModel(config))


@pytest.fixture(scope="module")
def starcoder() -> torch.nn.Module:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    config = GPTBigCodeConfig(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=96, multi_query=True)
    return seeded(lambda: GPTBigCodeForCausalLM(config))


@pytest.mark.parametrize("family", ["gpt2", "starcoder"])
def test_attention_and_mlp_c_proj_are_separate_targets(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    base = request.getfixturevalue(family)
    conv1d = family == "gpt2"  # GPT-2's transformers Conv1D stores [in, out]: PEFT's fan_in_fan_out
    adapters = {
        "both": save_peft_adapter(
            base,
            tmp_path / "both",
            1,
            r=4,
            lora_alpha=8,
            target_modules=["c_attn", "c_proj"],
            fan_in_fan_out=conv1d,
        ),
        "mlp": save_peft_adapter(
            base,
            tmp_path / "mlp",
            2,
            r=2,
            lora_alpha=4,
            target_modules=["mlp.c_proj", "c_fc"],
            fan_in_fan_out=conv1d,
        ),
        "attn1": save_peft_adapter(
            base,
            tmp_path / "attn1",
            3,
            r=8,
            lora_alpha=8,
            target_modules=r".*\.1\.attn\.c_proj",
            fan_in_fan_out=conv1d,
        ),
    }
    names = ["both", None, "mlp", "attn1", "both", None]
    mgr = check_against_peft(base, adapters, names, {"input_ids": ids(6, 5, 96)}, logits)
    keys = {g.key for g in mgr.targets.groups}
    assert {"transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_proj"} <= keys


# ---------------------------------------------------------------- vision-language: two towers, same names

IMAGE_TOKEN = 95


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    text = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=96,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    return seeded(lambda: LlavaForConditionalGeneration(config))


@pytest.fixture(scope="module")
def gemma3() -> torch.nn.Module:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    text = Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=96,
        sliding_window=8,
    )
    config = Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=93,
        eoi_token_index=94,
    )
    model = seeded(lambda: Gemma3ForConditionalGeneration(config))
    with torch.no_grad():  # initialised to zero, which would hide the vision tower from the logits
        model.get_parameter("model.multi_modal_projector.mm_input_projection_weight").normal_(0.0, 0.2)
    return model


def vlm_inputs(batch: int) -> dict[str, Any]:
    # Each sequence holds its one image's 4 image tokens (Llava: 16x16 pixels in 8x8 patches, CLS dropped;
    # Gemma 3: 16 patches pooled to 4), so the vision tower's batch is the sequences'.
    text = ids(batch, 6, 90)
    image = torch.full((batch, 4), IMAGE_TOKEN)
    pixels = torch.randn((batch, 3, 16, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": torch.cat([text[:, :2], image, text[:, 2:]], 1), "pixel_values": pixels}


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_vision_tower_and_language_model_share_names(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    base = request.getfixturevalue(family)
    keys = [k for k, _ in base.named_modules() if k.endswith("layers.0.self_attn.q_proj")]
    assert len(keys) == 2, keys  # the case this test is about: one per tower
    projector = ["linear_1"] if family == "llava" else []  # Gemma 3's projector is no linear layer
    adapters = {
        "text": save_peft_adapter(
            base,
            tmp_path / "text",
            1,
            r=4,
            lora_alpha=8,
            target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)",
        ),
        "vision": save_peft_adapter(
            base, tmp_path / "vision", 2, r=2, lora_alpha=4, target_modules=r".*vision_tower.*\.(q_proj|fc1)"
        ),
        "both": save_peft_adapter(
            base,
            tmp_path / "both",
            3,
            r=8,
            lora_alpha=4,
            target_modules=["q_proj", "o_proj", "out_proj", *projector],
        ),
    }
    names = ["text", "vision", None, "both", "text"]
    check_against_peft(base, adapters, names, vlm_inputs(len(names)), logits)


# ---------------------------------------------------------------- encoder-decoders


@pytest.fixture(scope="module")
def bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        init_std=0.2,  # the default 0.02 leaves an encoder-only adapter almost no effect on the logits
    )
    return seeded(lambda: BartForConditionalGeneration(config))


@pytest.fixture(scope="module")
def t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=96, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2
    )
    return seeded(lambda: T5ForConditionalGeneration(config))


def seq2seq_inputs(batch: int) -> dict[str, Any]:
    # Encoder and decoder lengths differ, so each layer's rows are sliced by its own input's length.
    return {"input_ids": ids(batch, 7, 96), "decoder_input_ids": ids(batch, 3, 96, seed=1)}


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_decoder_sequences_carry_their_adapter_through_both(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    base = request.getfixturevalue(family)
    attention = ["q_proj", "k_proj", "v_proj", "out_proj"] if family == "bart" else ["q", "k", "v", "o"]
    mlp = ["fc1", "fc2"] if family == "bart" else ["wi", "wo"]
    adapters = {
        "all": save_peft_adapter(
            base, tmp_path / "all", 1, r=4, lora_alpha=8, target_modules=attention + mlp
        ),
        "encoder": save_peft_adapter(
            base,
            tmp_path / "encoder",
            2,
            r=2,
            lora_alpha=4,
            target_modules=rf".*encoder\..*\.({'|'.join(attention)})",
        ),
        "cross": save_peft_adapter(
            base,
            tmp_path / "cross",
            3,
            r=8,
            lora_alpha=8,
            target_modules=r".*decoder\..*(encoder_attn|EncDecAttention)\.(k_proj|v_proj|k|v)",
        ),
    }
    names = [None, "all", "encoder", "cross", "all"]
    mgr = check_against_peft(base, adapters, names, seq2seq_inputs(len(names)), logits)
    layer0 = (
        "model.encoder.layers.0.self_attn.q_proj"
        if family == "bart"
        else "encoder.block.0.layer.0.SelfAttention.q"
    )
    twin = layer0.replace("encoder", "decoder")
    assert mgr.targets.linear(layer0) is not None and mgr.targets.linear(twin) is not None


# ---------------------------------------------------------------- Mamba: dt_proj read directly


@pytest.fixture(scope="module")
def mamba() -> torch.nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=96, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, use_cache=False
    )
    return seeded(lambda: MambaForCausalLM(config))


def test_mamba_with_dt_proj_targeted(mamba: torch.nn.Module, tmp_path: Path) -> None:
    # transformers 5's MambaMixer multiplies by dt_proj.weight instead of calling dt_proj, so a dt_proj LoRA
    # changes nothing there, in PEFT as here; x_proj's makes each adapter visible in the output.
    adapters = {
        "dt": save_peft_adapter(
            mamba, tmp_path / "dt", 1, r=2, lora_alpha=4, target_modules=["dt_proj", "x_proj"]
        ),
        "all": save_peft_adapter(
            mamba,
            tmp_path / "all",
            2,
            r=4,
            lora_alpha=8,
            target_modules=["in_proj", "x_proj", "dt_proj"],
        ),
    }
    names = ["dt", None, "all", None]
    check_against_peft(mamba, adapters, names, {"input_ids": ids(4, 5, 96)}, logits)


# ---------------------------------------------------------------- targets chosen by regex, refusals


@pytest.fixture(scope="module")
def neox() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return seeded(lambda: GPTNeoXForCausalLM(config))


def test_a_regex_start_up_adapter_selects_the_models_own_names(neox: torch.nn.Module, tmp_path: Path) -> None:
    adapters = {
        "qkv": save_peft_adapter(
            neox, tmp_path / "qkv", 1, r=4, lora_alpha=8, target_modules=r".*\.query_key_value"
        ),
        "mlp": save_peft_adapter(
            neox, tmp_path / "mlp", 2, r=2, lora_alpha=2, target_modules=["dense_h_to_4h"]
        ),
    }
    mgr = check_against_peft(neox, adapters, ["qkv", None, "mlp"], {"input_ids": ids(3, 4, 96)}, logits)
    assert set(mgr.targets.module_names) == {"query_key_value", "dense_h_to_4h"}


def test_refusals_name_the_module_and_the_way_out(gpt2: torch.nn.Module, tmp_path: Path) -> None:
    attn = save_peft_adapter(
        gpt2, tmp_path / "attn", 1, r=2, lora_alpha=2, target_modules=["attn.c_proj"], fan_in_fan_out=True
    )
    mlp = save_peft_adapter(
        gpt2, tmp_path / "mlp", 2, r=2, lora_alpha=2, target_modules=["mlp.c_proj"], fan_in_fan_out=True
    )
    head = save_peft_adapter(gpt2, tmp_path / "head", 3, r=2, lora_alpha=2, target_modules=["lm_head"])
    mgr = LoRAManager(
        copy.deepcopy(gpt2), [f"attn={attn}"], max_loras_per_batch=2, lora_target_modules=["attn.c_proj"]
    )
    assert [g.key for g in mgr.targets.groups] == [
        "transformer.h.0.attn.c_proj",
        "transformer.h.1.attn.c_proj",
    ]
    with pytest.raises(
        AdapterLoadError, match=r"'transformer.h.0.mlp.c_proj'.*not served: .*lora_target_modules="
    ):
        mgr.load("mlp", mlp)
    with pytest.raises(AdapterLoadError, match=r"'lm_head'.*not served: this manager does not wrap it"):
        mgr.load("head", head)
    with pytest.raises(SpecError, match=r"lora_target_modules names \['c_fc_typo'\]"):
        LoRAManager(copy.deepcopy(gpt2), [f"attn={attn}"], lora_target_modules=["c_proj", "c_fc_typo"])


# ---------------------------------------------------------------- Falcon: a linear with its own forward


@pytest.fixture(scope="module")
def falcon() -> torch.nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=96, bias=True, alibi=False
    )
    return seeded(lambda: FalconForCausalLM(config))


@pytest.mark.parametrize("targets", [["query_key_value", "dense_4h_to_h"], "all-linear"])
def test_falcon_linear_overriding_forward_but_returning_a_tensor_is_served(
    falcon: torch.nn.Module, tmp_path: Path, targets: Any
) -> None:
    # FalconLinear subclasses nn.Linear with its own forward (the bias added after the matmul); PEFT
    # wraps it as a linear, and so must lora_pin.
    adapters = {
        "a": save_peft_adapter(falcon, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=targets),
        "b": save_peft_adapter(
            falcon, tmp_path / "b", 2, r=2, lora_alpha=2, target_modules=["dense", "dense_h_to_4h"]
        ),
    }
    names: list[str | None] = ["a", None, "b", "a"]
    mgr = check_against_peft(falcon, adapters, names, {"input_ids": ids(4, 5, 96, seed=3)}, logits)
    assert {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"} <= set(mgr.targets.module_names)
