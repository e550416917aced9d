"""Run by tests/vllm/test_zeroing.py in the vLLM venv: vLLM's ``BaseLinearLayerWithLoRA.reset_lora`` as
the plugin patches it (:func:`lora_pin.vllm.seams.zeroing_once`) against vLLM's own, on twin layers' buffers
through activations, writes and a reallocation. Prints one JSON object:
``{"equal_after": [step names where the twins' buffers are equal], "steps": [...], "zeroings": N,
"resets": M}`` (``zeroings``: how many times vLLM's own function ran under the patched one)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

from lora_pin.vllm.seams import zeroing_once

SLOTS, R, IN, OUTS = 4, 8, 16, (12, 4, 4)
vllms_reset = BaseLinearLayerWithLoRA.reset_lora
zeroings = 0


def counted(layer: SimpleNamespace, index: int) -> None:
    global zeroings
    zeroings += 1
    vllms_reset(layer, index)


patched = zeroing_once(counted)


def layer() -> SimpleNamespace:
    """A fused q/k/v layer's LoRA buffers as vLLM allocates them (zeros), with what reset_lora reads."""
    return SimpleNamespace(
        n_slices=len(OUTS),
        lora_a_stacked=tuple(torch.zeros(SLOTS, 1, R, IN) for _ in OUTS),
        lora_b_stacked=tuple(torch.zeros(SLOTS, 1, out, R) for out in OUTS),
    )


def write(layer: SimpleNamespace, slot: int, value: float) -> None:
    """An adapter copied into a slot as vLLM's set_lora does (rank 4 of 8)."""
    for a in layer.lora_a_stacked:
        a[slot, 0, :4].copy_(torch.full((4, IN), value))
    for b in layer.lora_b_stacked:
        b[slot, 0, :, :4].copy_(torch.full((b.shape[2], 4), value))


ours, theirs = layer(), layer()
steps = [
    ("reset 0", lambda lay, reset: reset(lay, 0)),
    ("reset 0 again", lambda lay, reset: reset(lay, 0)),
    ("write 1", lambda lay, reset: write(lay, 1, 1.0)),
    ("reset 1 after its write", lambda lay, reset: reset(lay, 1)),
    ("reset 1 again", lambda lay, reset: reset(lay, 1)),
    ("write 0 where it was zeroed", lambda lay, reset: write(lay, 0, 5.0)),
    ("reset 0 after its write", lambda lay, reset: reset(lay, 0)),
    ("write 2 through a view", lambda lay, reset: lay.lora_b_stacked[1][2].view(-1).fill_(2.0)),
    ("reset 1 after a write elsewhere", lambda lay, reset: reset(lay, 1)),
    ("reset 2", lambda lay, reset: reset(lay, 2)),
    ("write 3", lambda lay, reset: write(lay, 3, 3.0)),
    ("reset 0 after a write elsewhere", lambda lay, reset: reset(lay, 0)),
    ("reset 3", lambda lay, reset: reset(lay, 3)),
    (
        "buffers allocated anew, holding data",
        lambda lay, reset: setattr(
            lay, "lora_a_stacked", tuple(torch.ones_like(a) for a in lay.lora_a_stacked)
        ),
    ),
    ("reset 0 after the reallocation", lambda lay, reset: reset(lay, 0)),
]
equal_after = []
for name, step in steps:
    step(ours, patched)
    step(theirs, vllms_reset)
    if all(
        torch.equal(x, y)
        for x, y in zip(
            (*ours.lora_a_stacked, *ours.lora_b_stacked),
            (*theirs.lora_a_stacked, *theirs.lora_b_stacked),
            strict=True,
        )
    ):
        equal_after.append(name)
resets = sum(name.startswith("reset") for name, _ in steps)
print(
    json.dumps(
        {"steps": [n for n, _ in steps], "equal_after": equal_after, "zeroings": zeroings, "resets": resets}
    )
)
