"""Admission that counts pins and never starves: :class:`Scheduler` (``--scheduler-cls
lora_pin.vllm.Scheduler``; ``lora-pin vllm-serve`` passes it).

vLLM's scheduler admits waiting requests first come, first served, up to ``--max-loras`` distinct
adapters per step, without counting pinned adapters: with pins holding slots, a step may then need more
slots than the worker has. This subclass decides, before each step, which waiting requests' adapters fit:
every slot a pin holds is reserved for it, the adapters of running requests keep theirs, and the rest of
the slots go to new adapters. Waiting requests are offered in the order: requests waiting longer than the
age bound (oldest first), then pinned adapters' requests, then those needing no new slot (the base
model's, those of adapters already running), then the rest: the ranking lora_pin's own engine admits by.
While an aged request's adapter finds no slot, no request of another unpinned adapter is admitted (a
running one's neither, aged or not), so the running ones drain and free one: nobody waits forever.
vLLM's own token and KV budgets then decide among the requests offered.

The rule is lora_pin's core (``admit_waiting``, ``rust/core/src/admission.rs``), not a copy of it here: this
class only tells it, each step, what vLLM holds.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from lora_pin._core import admit_waiting

__all__ = ["AGE_BOUND_ENV", "DEFAULT_AGE_BOUND", "Scheduler"]

#: Scheduler steps a request may wait before it goes first (``LORA_PIN_VLLM_AGE_BOUND`` overrides).
DEFAULT_AGE_BOUND = 64
AGE_BOUND_ENV = "LORA_PIN_VLLM_AGE_BOUND"


class Scheduler(VllmScheduler):
    """vLLM's scheduler with lora_pin's admission (see the module).

    Attributes:
        pinned_loras: vLLM adapter ids whose slot is reserved (set by the plugin's pin calls).

    It extends vLLM's synchronous ``Scheduler``, the one vLLM runs on CPU with LoRA (async scheduling is
    off there; where it is on, vLLM runs this one synchronously and says so in its log).

    Raises:
        ValueError: at construction, with a scheduling policy other than ``fcfs`` or a bad age bound.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.waiting, FCFSRequestQueue):
            raise ValueError("lora_pin.vllm.Scheduler supports --scheduling-policy fcfs only")
        raw = os.environ.get(AGE_BOUND_ENV, str(DEFAULT_AGE_BOUND))
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{AGE_BOUND_ENV} must be a positive number of steps, got {raw!r}")
        self.age_bound = int(raw)
        self.pinned_loras: set[int] = set()
        self._step = 0
        self._first_step: dict[str, int] = {}

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step over the waiting requests this admission offers; the others wait, in front."""
        self._step += 1
        held = self._hold_back()
        try:
            return super().schedule(*args, **kwargs)
        finally:
            if held:
                self.waiting.prepend_requests(held)

    def _hold_back(self) -> list[Any]:
        """Reorders the waiting queue as admission offers it and takes out the requests whose adapter
        finds no slot this step; returns them in order. The decision is the core's
        (``lora_pin._core.admit_waiting``); this keeps each request's first step, to count its wait."""
        if self.lora_config is None or not self.waiting:
            return []
        waiting = list(self.waiting)
        # Only waiting requests are remembered: a request scheduled (or finished) leaves the table.
        self._first_step = {r.request_id: self._first_step.get(r.request_id, self._step) for r in waiting}
        offered, held = admit_waiting(
            [lora_id(r) or None for r in waiting],
            [self._step - self._first_step[r.request_id] for r in waiting],
            running=[adapter for adapter in map(lora_id, self.running) if adapter],
            pinned=list(self.pinned_loras),
            slots=self.lora_config.max_loras,
            age_bound=self.age_bound,
        )
        self.waiting.clear()
        self.waiting.extend(waiting[i] for i in offered)
        return [waiting[i] for i in held]


def lora_id(request: Any) -> int:
    """vLLM's adapter id of ``request`` (0: the base model)."""
    return request.lora_request.lora_int_id if request.lora_request is not None else 0
