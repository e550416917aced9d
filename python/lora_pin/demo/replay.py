"""Replays a workload through a :class:`~lora_pin.LoRAManager` and reports speed, cache behaviour, pinned
residency and a correctness check of sampled steps against PEFT's own mixed-batch forward."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch

from lora_pin.demo.workload import Request
from lora_pin.model import LoRAManager

__all__ = ["ReplayReport", "replay"]


@dataclass
class ReplayReport:
    """What a replay measured."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    step_times: list[float] = field(default_factory=list)
    deferred: int = 0
    checked_steps: int = 0
    max_relative_error: float = 0.0
    adapter_effect: float = 0.0
    failed_steps: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    pinned: list[str] = field(default_factory=list)
    pinned_evictions: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the step times, in milliseconds."""
        if not self.step_times:
            return 0.0
        ordered = sorted(self.step_times)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index] * 1e3

    @property
    def ok(self) -> bool:
        """Outputs matched PEFT on every checked step and no pinned adapter was evicted."""
        return not self.failed_steps and not self.pinned_evictions

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_per_second": round(self.tokens_per_second, 1),
            "step_ms_p50": round(self.percentile_ms(50), 3),
            "step_ms_p99": round(self.percentile_ms(99), 3),
            "deferred_requests": self.deferred,
            "checked_steps": self.checked_steps,
            "max_relative_error": self.max_relative_error,
            "adapter_effect": self.adapter_effect,
            "failed_steps": self.failed_steps,
            "pinned": self.pinned,
            "pinned_evictions": self.pinned_evictions,
            "stats": self.stats,
            "ok": self.ok,
        }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().clamp_min(1e-12)
    return float((got - want).abs().max() / scale)


def replay(
    manager: LoRAManager,
    requests: Sequence[Request],
    *,
    batch_size: int,
    prefill_len: int,
    vocab_size: int,
    oracle: Any | None = None,
    check_every: int = 0,
    tolerance: float = 1e-4,
    seed: int = 0,
    progress: bool = True,
) -> ReplayReport:
    """Serve ``requests`` in steps of at most ``batch_size`` sequences (prefill steps of ``prefill_len``
    tokens, decode steps of one token), deferring what does not fit the slots to the next step. While a
    step runs, the adapters of the next step's requests are prefetched.

    Every ``check_every``-th step (0: never) is recomputed by ``oracle`` (a PEFT model holding every
    adapter, called with ``adapter_names``) and compared within ``tolerance`` relative to the largest logit.
    With ``progress``, a progress bar goes to stderr when stderr is a terminal (never into logs).
    """
    from tqdm import tqdm

    report = ReplayReport()
    queue = {
        True: deque(r for r in requests if r.prefill),
        False: deque(r for r in requests if not r.prefill),
    }
    gen = torch.Generator().manual_seed(seed)
    # disable=None: tqdm draws only when stderr is a terminal, so logs and pipes get no bar.
    disable = None if progress else True
    bar = tqdm(total=len(requests), unit="req", disable=disable, desc="lora-pin demo", leave=False)
    kind = True
    with torch.inference_mode():
        while queue[True] or queue[False]:
            if not queue[kind]:
                kind = not kind
            names = _admit(manager, queue[kind], batch_size, report)
            length = prefill_len if kind else 1
            ids = torch.randint(0, vocab_size, (len(names), length), generator=gen).to(manager.device)
            logits = _step(manager, names, ids, queue[not kind], batch_size, report)
            if oracle is not None and check_every and report.steps % check_every == 1 % check_every:
                _check(manager, oracle, names, ids, logits, tolerance, report)
            bar.update(len(names))
            kind = not kind
    bar.close()
    _final_stats(manager, report)
    return report


def _admit(manager: LoRAManager, waiting: deque[Request], batch_size: int, report: ReplayReport) -> list[Any]:
    """Take up to ``batch_size`` requests from ``waiting``; those that do not fit the slots go back to its
    front, in order. Returns the admitted requests' adapter names."""
    batch = [waiting.popleft() for _ in range(min(batch_size, len(waiting)))]
    names = [r.adapter for r in batch]
    admitted = manager.split(names)[0]
    for i in reversed([i for i in range(len(batch)) if i not in set(admitted)]):
        waiting.appendleft(batch[i])
    report.deferred += len(batch) - len(admitted)
    return [names[i] for i in admitted]


def _step(
    manager: LoRAManager,
    names: list[Any],
    ids: torch.Tensor,  # [len(names), length]
    upcoming: deque[Request],
    batch_size: int,
    report: ReplayReport,
) -> torch.Tensor:
    """Run one timed step of ``ids`` under ``names``; returns its logits ``[len(names), length, vocab]``."""
    t0 = time.perf_counter()
    with manager.batch(names):
        # The next step's adapters start loading while this one runs: now, not before it began,
        # since its own adapters are protected from the evictions those reads make room by.
        # (Every tensor-parallel rank replays the same queue, so all prefetch alike.)
        if manager.loading == "background":
            manager.prefetch(r.adapter for r in islice(upcoming, batch_size))
        logits = manager.model(ids).logits
    elapsed = time.perf_counter() - t0
    report.step_times.append(elapsed)
    report.seconds += elapsed
    report.tokens += ids.numel()
    report.steps += 1
    return logits


def _check(
    manager: LoRAManager,
    oracle: Any,
    names: list[Any],
    ids: torch.Tensor,
    logits: torch.Tensor,
    tolerance: float,
    report: ReplayReport,
) -> None:
    """Compare the step's ``logits`` with ``oracle``'s (PEFT's mixed batch) within ``tolerance``."""
    want = oracle(ids, adapter_names=[n or "__base__" for n in names]).logits
    err = _relative_error(logits.float(), want.float())
    report.checked_steps += 1
    report.max_relative_error = max(report.max_relative_error, err)
    if err > tolerance:
        report.failed_steps.append(report.steps)
    # How far the adapters moved the logits from the base model's: a check that compares
    # two base-model outputs would prove nothing.
    base = manager.model(ids).logits
    report.adapter_effect = max(report.adapter_effect, _relative_error(base.float(), want.float()))


def _final_stats(manager: LoRAManager, report: ReplayReport) -> None:
    """The manager's stats at the end, and the evictions of pinned adapters (there should be none)."""
    stats = manager.stats()
    report.stats = stats
    # Every pinned adapter (the host tier holds them all), not only those in a device slot now.
    report.pinned = list(stats["host"]["pinned"])
    report.pinned_evictions = {
        key: count
        for key, count in stats["evictions_by_adapter"].items()
        if key.rsplit("/", 1)[0] in set(report.pinned)
    }
