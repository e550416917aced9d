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

With ``LORA_PIN_VLLM_ROTATE=1`` it *rotates* instead of draining, as lora_pin's own engine does: running
requests take part in admission too (``admit_rotating``), their wait the steps since they were last
scheduled, and a request aged past the age bound (then 4 steps by default) takes the slot of a running
unpinned adapter, whose running requests are *suspended*: taken out of ``self.running`` for the step and
put back after, in their order, until they are aged in turn. A pinned adapter's requests are never
suspended; with no aged request nothing scheduled in the previous step is suspended; no request waits
more than ``age_bound + d // (max_loras - pins)`` steps, ``d`` the other unpinned adapters in flight
(if vLLM's budgets schedule what is offered). Checked against vLLM 0.32 that a running request left
out of a step is safe, the same as one the token budget leaves out:

- worker: ``GPUModelRunner._update_states`` (the CPU runner's too) removes a request that is not
  scheduled from the persistent batch but keeps its cached state (tokens, block ids); when it is
  scheduled again it is re-added from that state;
- scheduler: ``_make_cached_request_data`` sends its whole token list again when it was not in
  ``prev_step_scheduled_req_ids``; it is not in ``resumed_req_ids`` (that is for preempted requests),
  so the worker appends its new blocks to the ones it kept;
- KV blocks: it keeps them (nothing frees a running request's blocks but finishing or preemption);
  vLLM preempts from the end of ``self.running`` when blocks run out, and a suspended one is not in it
  during the step: it is never preempted for the step's requests and keeps its place;
- ``max_num_seqs``: ``max_num_running_reqs`` is lowered by the suspended count for the step, so vLLM
  admits no more requests than it would with them in ``self.running``.

The rule is lora_pin's core (``admit_waiting`` and ``admit_rotating``, ``rust/core/src/admission.rs``),
not a copy of it here: this class only tells it, each step, what vLLM holds.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from lora_pin._core import admit_rotating, admit_waiting

__all__ = ["AGE_BOUND_ENV", "DEFAULT_AGE_BOUND", "DEFAULT_ROTATE_AGE_BOUND", "ROTATE_ENV", "Scheduler"]

#: Scheduler steps a request may wait before it goes first (``LORA_PIN_VLLM_AGE_BOUND`` overrides).
DEFAULT_AGE_BOUND = 64
#: The same with rotation on: a few steps, so that a new adapter's first token comes soon.
DEFAULT_ROTATE_AGE_BOUND = 4
AGE_BOUND_ENV = "LORA_PIN_VLLM_AGE_BOUND"
#: ``1``: rotate slots among adapters (suspend running requests for aged ones); unset or ``0``: drain.
ROTATE_ENV = "LORA_PIN_VLLM_ROTATE"

# Under vLLM's logger, so that its handler and VLLM_LOGGING_LEVEL apply.
_log = logging.getLogger("vllm.lora_pin.rotation")


class Scheduler(VllmScheduler):
    """vLLM's scheduler with lora_pin's admission (see the module).

    Attributes:
        pinned_loras: vLLM adapter ids whose slot is reserved (set by the plugin's pin calls).
        rotate: whether it rotates (``LORA_PIN_VLLM_ROTATE=1``) rather than drains.
        age_bound: steps of waiting after which a request goes first.

    It extends vLLM's synchronous ``Scheduler``, the one vLLM runs on CPU with LoRA (async scheduling is
    off there; where it is on, vLLM runs this one synchronously and says so in its log).

    Raises:
        ValueError: at construction, with a scheduling policy other than ``fcfs``, a bad age bound or a
            ``LORA_PIN_VLLM_ROTATE`` other than ``0`` or ``1``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.waiting, FCFSRequestQueue):
            raise ValueError("lora_pin.vllm.Scheduler supports --scheduling-policy fcfs only")
        rotate = os.environ.get(ROTATE_ENV, "0")
        if rotate not in ("0", "1"):
            raise ValueError(f"{ROTATE_ENV} must be 0 or 1, got {rotate!r}")
        self.rotate = rotate == "1"
        default = DEFAULT_ROTATE_AGE_BOUND if self.rotate else DEFAULT_AGE_BOUND
        raw = os.environ.get(AGE_BOUND_ENV, str(default))
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{AGE_BOUND_ENV} must be a positive number of steps, got {raw!r}")
        self.age_bound = int(raw)
        self.pinned_loras: set[int] = set()
        self._step = 0
        self._first_step: dict[str, int] = {}
        self._last_step: dict[str, int] = {}
        self._suspended_names: list[str] = []

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step over the requests this admission offers: the waiting ones it holds wait, in front;
        with rotation, the running ones it suspends sit the step out and keep their place."""
        self._step += 1
        if self.rotate and self.lora_config is not None:
            return self._schedule_rotating(*args, **kwargs)
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

    def _schedule_rotating(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`schedule` with rotation: the core (``lora_pin._core.admit_rotating``) decides over the
        running and waiting requests; the suspended ones leave ``self.running`` for vLLM's step and come
        back after in their order (also when the step raises), the held ones go back in front of the
        waiting queue. Keeps each waiting request's first step and each running one's last scheduled
        step, to count their waits, and logs (INFO, ``vllm.lora_pin.rotation``) each change of the
        adapters whose running requests are suspended."""
        running, waiting = list(self.running), list(self.waiting)
        self._first_step = {r.request_id: self._first_step.get(r.request_id, self._step) for r in waiting}
        # A running request is scheduled at least once before it is running: one not seen yet was
        # scheduled in the previous step.
        last = {r.request_id: self._last_step.get(r.request_id, self._step - 1) for r in running}
        offered, held_at, suspended_at = admit_rotating(
            [lora_id(r) or None for r in running + waiting],
            [self._step - 1 - last[r.request_id] for r in running]
            + [self._step - self._first_step[r.request_id] for r in waiting],
            [True] * len(running) + [False] * len(waiting),
            pinned=list(self.pinned_loras),
            slots=self.lora_config.max_loras,
            age_bound=self.age_bound,
        )
        suspended = {running[i].request_id for i in suspended_at}
        names = sorted({running[i].lora_request.lora_name for i in suspended_at})
        if names != self._suspended_names:
            # Once per change of the suspended adapters, not per step: what tests and operators read.
            _log.info(
                "lora_pin rotation: step %d suspends the running requests of adapters %s", self._step, names
            )
            self._suspended_names = names
        held = [waiting[i - len(running)] for i in held_at]
        self.running = [r for r in running if r.request_id not in suspended]
        self.waiting.clear()
        self.waiting.extend(waiting[i - len(running)] for i in offered if i >= len(running))
        max_running = self.max_num_running_reqs
        # Suspended requests still count against --max-num-seqs.
        self.max_num_running_reqs = max_running - len(suspended)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_running_reqs = max_running
            self.running = restore_running(running, suspended, self.running)
            if held:
                self.waiting.prepend_requests(held)
        self._last_step = {r.request_id: last.get(r.request_id, self._step) for r in self.running}
        for request_id in output.num_scheduled_tokens:
            if request_id in self._last_step:
                self._last_step[request_id] = self._step
        return output


def restore_running(before: list[Any], suspended: set[str], after: list[Any]) -> list[Any]:
    """The running list once a step is over: the requests of ``before`` (the list as the step began) that
    are suspended or still in ``after`` (vLLM's list after the step: preempted ones gone, started ones
    appended), in ``before``'s order, then those new in ``after``, in its order."""
    still = {r.request_id for r in after}
    kept = [r for r in before if r.request_id in suspended or r.request_id in still]
    known = {r.request_id for r in kept}
    return kept + [r for r in after if r.request_id not in known]


def lora_id(request: Any) -> int:
    """vLLM's adapter id of ``request`` (0: the base model)."""
    return request.lora_request.lora_int_id if request.lora_request is not None else 0
