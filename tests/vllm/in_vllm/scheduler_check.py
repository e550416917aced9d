"""Run by tests/vllm/test_scheduler.py in the vLLM venv: ``lora_pin.vllm.Scheduler``'s admission over vLLM's
own ``Request`` objects and waiting queue (``FCFSRequestQueue``), step by step, without an engine: each step
the scheduler reorders the queue and takes out what it holds (``_hold_back``, as ``schedule`` does before
vLLM's own step), every request left in the queue starts running for ``RUN`` steps, and the held ones go
back in front (``prepend_requests``, as ``schedule`` does after). The scheduler's constructor is vLLM's
(engine configs); the state the admission reads is set as that constructor sets it.

Prints one JSON object: ``{"offered_at": {request id: step}, "queues": [[request ids in queue order
after the step's reordering], ...]}``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
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
for step in range(1, 14):
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

print(json.dumps({"offered_at": offered_at, "queues": queues}))
