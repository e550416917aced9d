"""``TopEvictions``: at most ``cap`` keys, every eviction counted (listed or in ``others``), the adapters
evicted most kept with their exact counts, against a plain ``Counter`` of the same stream."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lora_pin.model.eviction_counts import TopEvictions


def test_a_stream_of_new_names_keeps_the_heavy_ones_exactly() -> None:
    rng = random.Random(0)
    top, exact = TopEvictions(cap=16), Counter[tuple[str, str]]()
    hot = [(f"hot{i}", "device") for i in range(4)]
    for i in range(5000):
        key = hot[i % 4] if i % 3 == 0 else (f"cold{rng.randrange(10**6)}", "host")
        top[key] += 1
        exact[key] += 1
        assert len(top) <= 16
    assert sum(top.values()) + top.others == sum(exact.values())
    for key in hot:
        assert top[key] == exact[key]


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cap must be at least 1"):
        TopEvictions(cap=0)
