"""The LoRA layers' step bookkeeping (``lora_pin.model.layers``), without a model."""

from __future__ import annotations

import pytest
import torch

from lora_pin import UsageError
from lora_pin.model.segments import StepSegments


def test_an_input_that_does_not_split_into_the_steps_sequences_is_a_usage_error() -> None:
    step = StepSegments(sequence_slots=torch.tensor([0, -1, 1]))
    for shape in [(2, 4, 8), (7, 8)]:  # a batch of 2 for a step of 3 sequences; 7 rows for 3
        with pytest.raises(UsageError, match=r"does not split into the step's 3 sequences"):
            step.for_input(torch.zeros(shape))
    # Beams: two contiguous copies of each sequence of 4 tokens make 8 rows per step sequence.
    segments = step.for_input(torch.zeros(6, 4, 8))
    assert segments.perm.tolist() == [*range(0, 8), *range(16, 24)]
    assert segments.seg_slots.tolist() == [0, 1]
