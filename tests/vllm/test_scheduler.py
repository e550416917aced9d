"""``lora_pin.vllm.Scheduler``'s admission over vLLM's own requests and waiting queue, step by step
(``in_vllm/scheduler_check.py``, run in the vLLM venv; no engine). The rule itself is the core's
(``admit_waiting``), checked against a plain model in tests/core/test_admission.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "in_vllm" / "scheduler_check.py"


@pytest.fixture(scope="module")
def report(vllm_python: Path) -> dict[str, object]:
    done = subprocess.run([str(vllm_python), str(CHECK)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pinned_first_then_running_and_base_in_queue_order(report: dict[str, object]) -> None:
    # Step 2: hot1 (adapter 2, running), cold (3, no slot left: held), pin (1, pinned), base arrive in
    # that order; the queue vLLM schedules from is the core's order, cold taken out.
    queues = report["queues"]
    assert isinstance(queues, list)
    assert queues[1] == ["pin", "hot1", "base"]


def test_a_busy_adapter_drains_for_an_aged_request(report: dict[str, object]) -> None:
    offered_at = report["offered_at"]
    assert isinstance(offered_at, dict)
    # Base and pinned requests never wait.
    assert (offered_at["pin"], offered_at["base"]) == (2, 2)
    # cold is aged at step 3 (bound 1): adapter 2's requests wait from then on, aged or not, and its last
    # one running (hot1, steps 2-4) ends before step 5. Had aged requests of a running adapter been let
    # in, adapter 2 (a request every step) would have kept the slot as long as its traffic lasted.
    assert offered_at["cold"] == 5
    # Then adapter 2's held requests wait for cold's run (steps 5-7) and go together.
    assert [offered_at[f"hot{s}"] for s in range(10)] == [1, 2, 8, 8, 8, 8, 8, 8, 9, 10]
