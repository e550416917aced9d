"""Tiny models and PEFT adapters generated locally, for the tests and the ``lora-pin demo`` command.

Nothing here downloads anything: the base model is built from a ``LlamaConfig`` with random weights and
the adapters are made by PEFT over it. ``transformers`` and ``peft`` are imported inside the functions;
they are test and demo dependencies, not runtime ones.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "CANCEL_MODULE",
    "CANCEL_RATIOS",
    "ZERO_FEATURE",
    "make_cancelling_dora",
    "make_peft_adapter",
    "make_tiny_llama",
    "save_char_tokenizer",
    "save_peft_adapter",
]


def make_tiny_llama(
    directory: str | os.PathLike[str],
    *,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 128,
    seed: int = 0,
) -> Path:
    """Save a tiny random ``LlamaForCausalLM`` (fp32, safetensors) under ``directory`` and return the path.

    q_proj is ``[hidden, hidden]``, k_proj/v_proj ``[hidden // heads * kv_heads, hidden]``, gate/up
    ``[intermediate, hidden]``, down ``[hidden, intermediate]`` (weights stored ``[out, in]``).

    Raises:
        ValueError: from ``LlamaConfig`` when ``hidden`` is not divisible by ``heads``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path = Path(directory)
    model.save_pretrained(path)
    return path


def make_peft_adapter(
    base: str | os.PathLike[str] | torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    r: int,
    lora_alpha: float,
    target_modules: Sequence[str] | str,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    layers_to_transform: Sequence[int] | None = None,
    seed: int = 0,
    init: str = "random",
    **extra_config: Any,
) -> Path:
    """Save a PEFT LoRA adapter over ``base`` (a model directory or a loaded model) and return its directory.

    With ``init="random"`` both ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` are drawn from a seeded
    normal distribution (PEFT starts B at zero, which would make every output equal the base model's);
    ``init="peft"`` keeps PEFT's own initialisation. ``extra_config`` is passed to ``LoraConfig`` as is
    (for example ``use_dora=True`` or ``bias="all"`` to build adapters lora_pin must refuse).

    Raises:
        ValueError: ``init`` is neither ``"random"`` nor ``"peft"``, or PEFT rejects the configuration.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if init not in ("random", "peft"):
        raise ValueError(f"make_peft_adapter: init must be 'random' or 'peft', got {init!r}")
    model = AutoModelForCausalLM.from_pretrained(base) if not isinstance(base, torch.nn.Module) else base
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int, computes in float
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        layers_to_transform=None if layers_to_transform is None else list(layers_to_transform),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        **extra_config,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    if init == "random":
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    path = Path(out_dir)
    peft_model.save_pretrained(str(path))
    # get_peft_model wraps the caller's model in place; undo it so the same model can make more adapters.
    if isinstance(base, torch.nn.Module):
        peft_model.unload()
    return path


def save_peft_adapter(
    base: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    seed: int,
    *,
    scale: float = 0.1,
    magnitude_spread: float = 0.3,
    **config: Any,
) -> Path:
    """Save a PEFT adapter made from ``LoraConfig(**config)`` as given (any targets: ``target_parameters``,
    ``lm_head``, embeddings), over a copy of ``base`` (left untouched), with every LoRA tensor drawn from a
    seeded normal distribution times ``scale`` (PEFT starts B at zero); returns its directory.

    A DoRA adapter's magnitudes (``use_dora=True``; PEFT starts them at ``||W||``, which with B = 0 makes
    every factor 1) are each multiplied by ``1 + magnitude_spread * N(0, 1)`` from the same generator, so
    the factors are far from 1 and a rescale done wrong shows.

    Raises:
        ValueError: PEFT rejects the configuration.
    """
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(lora_dropout=0.0, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + magnitude_spread * torch.randn(param.shape, generator=generator))
            elif ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    path = Path(out_dir)
    peft_model.save_pretrained(str(path))
    return path


#: The output features of layer 0's ``down_proj`` that :func:`make_cancelling_dora` makes, each with its
#: ``||W_i + s B_i A|| / ||W_i||`` (1: no cancellation), and the feature whose row of ``W + s B A`` is
#: exactly zero in the ``zero`` adapter (a ratio-1 row in the ``cancel`` adapter).
CANCEL_RATIOS = {0: 1.0, 1: 1e-2, 2: 1e-3, 3: 1e-4, 4: 1e-6}
ZERO_FEATURE = 5
CANCEL_MODULE = "model.layers.0.mlp.down_proj"


def make_cancelling_dora(
    base: torch.nn.Module, root: str | os.PathLike[str], seed: int = 0
) -> dict[str, Path]:
    """Edit the Llama ``base`` in place and save two DoRA adapters over it whose rows of ``W + s B A``
    cancel (layer 0's ``down_proj``, rank 4, alpha 8, so ``s = 2``); returns ``{"cancel": ..., "zero": ...}``.

    A and B hold small integers and A is zero on the odd input columns, so ``s B A`` is exact in float32
    and bfloat16 (integers up to 48) and in any order of summation. Row ``i`` of :data:`CANCEL_RATIOS`
    (ratio below 1) gets ``W_i = -s B_i A`` on the even columns and, on the odd ones, a residual whose norm
    is the ratio times ``||W_i||`` (bfloat16 values, so the model cast to bfloat16 keeps them): the row of
    ``W + s B A`` is that residual, and ``W`` is up to 1e6 times larger. Its magnitude is ``||W_i||`` (a
    factor of 1 / ratio), so its output is as large as an uncancelled row's; every other row's is
    ``||W_i + s B_i A||`` times a uniform draw from [0.7, 1.3] (a trained adapter's factors stay near 1,
    and PEFT's ``base + (f - 1) base`` would itself cancel for a factor far below 1). ``zero`` differs
    from ``cancel`` in B's row :data:`ZERO_FEATURE` only, which cancels that row of ``W`` (zero on the odd
    columns) exactly.

    Layer 0's ``up_proj`` rows at even indices are zeroed, so ``down_proj``'s input is zero on the even
    columns: ``A x`` is exactly 0 and each row's output is its residual's product with ``x`` scaled by the
    factor, computed alike in any dtype: the outputs then measure the factors, not the layer's own
    cancellation of ``W x`` against ``s B A x`` (which no dtype resolves at these ratios).
    """
    import torch
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    weight = base.get_parameter(f"{CANCEL_MODULE}.weight").detach()  # [64, 128]
    out, width = weight.shape
    a = torch.randint(-3, 4, (4, width), generator=generator).float()
    a[:, 1::2] = 0
    b = torch.randint(-2, 3, (out, 4), generator=generator).float()
    for row in [*CANCEL_RATIOS, ZERO_FEATURE]:
        if not b[row].any():
            b[row, 0] = 1
    b[[r for r, ratio in CANCEL_RATIOS.items() if ratio == 1]] = 0
    scaled = 2 * b @ a  # s B A, exact
    with torch.no_grad():
        base.get_parameter("model.layers.0.mlp.up_proj.weight")[0::2] = 0
        for row, ratio in [*CANCEL_RATIOS.items(), (ZERO_FEATURE, 0.0)]:
            if ratio == 1:
                continue
            cancelled = scaled[row].norm()
            residual = torch.randn(width // 2, generator=generator)
            residual *= ratio * cancelled / (1 - ratio**2) ** 0.5 / residual.norm()
            weight[row, 0::2] = -scaled[row, 0::2]
            weight[row, 1::2] = residual.to(torch.bfloat16).float()
    magnitude_of = f"base_model.model.{CANCEL_MODULE}.lora_magnitude_vector"
    made = {}
    for name in ("cancel", "zero"):
        path = save_peft_adapter(
            base,
            Path(root) / name,
            seed,
            r=4,
            lora_alpha=8,
            target_modules=["down_proj"],
            layers_to_transform=[0],
            use_dora=True,
        )
        tensors = load_file(str(path / "adapter_model.safetensors"))
        rows = b.clone()
        if name == "cancel":
            rows[ZERO_FEATURE] = 0
        magnitude = (weight + 2 * rows @ a).norm(dim=1) * (0.7 + 0.6 * torch.rand(out, generator=generator))
        magnitude[list(CANCEL_RATIOS)] = weight[list(CANCEL_RATIOS)].norm(dim=1)
        tensors.update(
            {
                f"base_model.model.{CANCEL_MODULE}.lora_A.weight": a,
                f"base_model.model.{CANCEL_MODULE}.lora_B.weight": rows,
                magnitude_of: magnitude,
            }
        )
        save_file(tensors, str(path / "adapter_model.safetensors"))
        made[name] = path
    return made


def save_char_tokenizer(directory: str | os.PathLike[str]) -> Path:
    """Save a character-level tokenizer for the tiny models (vocab 128) under ``directory``; returns it.

    Each ASCII character is its own token (id = its code point), except ids 0, 1 and 2: ``<unk>`` (any
    other character), ``<s>`` and ``</s>`` (the end of sequence). It has a chat template
    (``role: content`` lines, then ``assistant:``), so a model folder holding it can be served over HTTP.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(3, 128)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    path = Path(directory)
    fast.save_pretrained(path)
    return path
