"""A mixed serving workload: Zipf-popular adapters, some base-model requests, prefill and decode steps."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Request", "make_requests"]


@dataclass(frozen=True)
class Request:
    """One sequence to serve: its adapter (None: the base model) and whether it is a prefill or a decode."""

    adapter: str | None
    prefill: bool


def make_requests(
    adapters: Sequence[str],
    count: int,
    *,
    zipf_alpha: float = 1.1,
    base_fraction: float = 0.15,
    prefill_fraction: float = 0.25,
    seed: int = 0,
) -> list[Request]:
    """``count`` requests; adapter ``adapters[k]`` is drawn with weight ``1 / (k + 1) ** zipf_alpha``.

    Raises:
        ValueError: ``adapters`` is empty, or a fraction is outside [0, 1].
    """
    if not adapters:
        raise ValueError("make_requests: no adapters to draw from")
    for what, value in (("base_fraction", base_fraction), ("prefill_fraction", prefill_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"make_requests: {what} must be in [0, 1], got {value}")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_alpha for k in range(len(adapters))]
    out = []
    for _ in range(count):
        adapter = None if rng.random() < base_fraction else rng.choices(adapters, weights)[0]
        out.append(Request(adapter, rng.random() < prefill_fraction))
    return out
