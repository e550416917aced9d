"""Run by tests/vllm/test_scheduler.py in the vLLM venv: ``lora_pin.vllm.Scheduler``'s admission over vLLM's
own ``Request`` objects and waiting queue (``FCFSRequestQueue``), step by step, without an engine: each step
the scheduler reorders the queue and takes out what it holds (``_hold_back``, as ``schedule`` does before
vLLM's own step), every request left in the queue starts running for ``RUN`` steps, and the held ones go
back in front (``prepend_requests``, as ``schedule`` does after). The scheduler's constructor is vLLM's
(engine configs); the state the admission reads is set as that constructor sets it.

Then rotation (``LORA_PIN_VLLM_ROTATE=1``, ``Scheduler.schedule``) over a stand-in for vLLM's own step
(``VllmScheduler.schedule`` replaced here: it schedules one token of every request in ``self.running`` and
starts every waiting one, as vLLM does with budgets to spare; at step ``RAISE_AT`` it raises, as a failing
step would), with the requests' tokens counted down and finished ones taken out of ``self.running`` as
vLLM's ``update_from_output`` does.

Prints one JSON object: ``{"offered_at": {request id: step}, "queues": [[request ids in queue order
after the step's reordering], ...], "rotation": {"scheduled": [[request ids vLLM's step saw running and
started], ...], "running_after": [[request ids in self.running after the step], ...], "max_running":
[vLLM's max_num_running_reqs during the step], "max_after": [the same after], "raised": {"step": n,
"running_kept": bool, "waiting_kept": bool}}}``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import Request

from lora_pin.vllm.scheduler import Scheduler

RUN = 3
SLOTS = 2
AGE_BOUND = 1
# (request id, adapter id or 0 for the base model, step before the one it arrives at): adapter 1 is
# pinned, adapter 2 gets a request every step, adapter 3's one request finds no free slot until 2 drains.
ARRIVALS = [
    *[(f"hot{s}", 2, s) for s in range(10)],
    ("cold", 3, 1),
    ("pin", 1, 1),
    ("base", 0, 1),
]


# Rotation: two slots, adapter 1 pinned, so one for the rest. (request id, adapter, arrival step, tokens):
# "long" (adapter 2) runs first; "late" (adapter 3) arrives at step 2 and is aged at step 4 (bound 2).
ROTATE_AGE_BOUND = 2
ROTATE_ARRIVALS = [
    ("long", 2, 1, 8),
    ("pin", 1, 1, 12),
    ("late", 3, 2, 3),
    ("base", 0, 3, 4),
    ("other", 4, 4, 2),
]
RAISE_AT = 5
MAX_RUNNING = 16


def request(request_id: str, adapter: int) -> Request:
    lora = LoRARequest(f"ad{adapter}", adapter, f"/adapters/ad{adapter}") if adapter else None
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=1), None, lora_request=lora)


scheduler: Any = Scheduler.__new__(Scheduler)
scheduler.waiting = FCFSRequestQueue()
scheduler.running = []
scheduler.lora_config = SimpleNamespace(max_loras=SLOTS)
scheduler.pinned_loras = {1}
scheduler.age_bound = AGE_BOUND
scheduler._step = 0
scheduler._first_step = {}

ends: dict[str, int] = {}
offered_at: dict[str, int] = {}
queues: list[list[str]] = []
for step in range(1, 20):
    scheduler._step = step
    scheduler.running = [r for r in scheduler.running if ends[r.request_id] > step]
    for request_id, adapter, arrival in ARRIVALS:
        if arrival == step - 1:
            scheduler.waiting.add_request(request(request_id, adapter))
    held = scheduler._hold_back()
    queues.append([r.request_id for r in scheduler.waiting])
    while scheduler.waiting:
        started = scheduler.waiting.pop_request()
        offered_at[started.request_id] = step
        ends[started.request_id] = step + RUN
        scheduler.running.append(started)
    scheduler.waiting.prepend_requests(held)


def vllm_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's step, as the stand-in above."""
    if self._step == RAISE_AT:
        raise RuntimeError("the step failed")
    rotation["max_running"].append(self.max_num_running_reqs)
    scheduled = [r.request_id for r in self.running]
    while self.waiting:
        started = self.waiting.pop_request()
        self.running.append(started)
        scheduled.append(started.request_id)
    rotation["scheduled"].append(scheduled)
    return SimpleNamespace(num_scheduled_tokens=dict.fromkeys(scheduled, 1))


VllmScheduler.schedule = vllm_step  # type: ignore[method-assign]
rotation: dict[str, Any] = {"scheduled": [], "running_after": [], "max_running": [], "max_after": []}
rotating: Any = Scheduler.__new__(Scheduler)
rotating.waiting = FCFSRequestQueue()
rotating.running = []
rotating.lora_config = SimpleNamespace(max_loras=SLOTS)
rotating.pinned_loras = {1}
rotating.rotate = True
rotating.age_bound = ROTATE_AGE_BOUND
rotating.max_num_running_reqs = MAX_RUNNING
rotating._step = 0
rotating._first_step = {}
rotating._last_step = {}
rotating._suspended_names = []
left = {request_id: tokens for request_id, _, _, tokens in ROTATE_ARRIVALS}
for step in range(1, 20):
    for request_id, adapter, arrival, _ in ROTATE_ARRIVALS:
        if arrival == step:
            rotating.waiting.add_request(request(request_id, adapter))
    if step == RAISE_AT:
        running_before, waiting_before = list(rotating.running), list(rotating.waiting)
        try:
            rotating.schedule()
        except RuntimeError:
            rotation["raised"] = {
                "step": step,
                "running_kept": rotating.running == running_before,
                "waiting_kept": list(rotating.waiting) == waiting_before,
            }
        rotation["scheduled"].append([])
        rotation["max_running"].append(None)
    else:
        output = rotating.schedule()
        for request_id in output.num_scheduled_tokens:
            left[request_id] -= 1
    rotating.running = [r for r in rotating.running if left[r.request_id] > 0]
    rotation["running_after"].append([r.request_id for r in rotating.running])
    rotation["max_after"].append(rotating.max_num_running_reqs)

print(json.dumps({"offered_at": offered_at, "queues": queues, "rotation": rotation}))
