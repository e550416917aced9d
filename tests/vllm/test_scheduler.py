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


def test_rotation_suspends_a_running_adapter_for_an_aged_one(report: dict[str, object]) -> None:
    rotation = report["rotation"]
    assert isinstance(rotation, dict)
    # One slot beside the pin, age bound 2. late (arrived at step 2) is aged at step 4 and takes long's
    # slot; step 5 raised; at step 6 long and other (arrived at step 4) are both aged 2 steps, long
    # first (running, given first), late sits out; then each aged one in turn, oldest first: other
    # (3 steps) at 7, late (3) at 8, long (2) at 9, other (2) at 10, late (2) at 11. The pinned request and
    # the base one are never left out.
    assert rotation["scheduled"] == [
        ["pin", "long"],
        ["pin", "long"],
        ["pin", "long", "base"],
        ["pin", "base", "late"],
        [],
        ["pin", "long", "base"],
        ["pin", "base", "other"],
        ["pin", "late"],
        ["pin", "long"],
        ["pin", "other"],
        ["pin", "late"],
        ["pin", "long"],
        ["pin", "long"],
        ["long"],
        *[[]] * 5,
    ]
    # A suspended request keeps its place in vLLM's running list and still counts against max_num_seqs.
    assert rotation["running_after"][6] == ["pin", "long", "late", "other"]
    assert rotation["max_running"][3:11] == [15, None, 15, 14, 14, 14, 14, 15]
    assert set(rotation["max_after"]) == {16}


def test_a_failing_step_leaves_the_queues_as_they_were(report: dict[str, object]) -> None:
    rotation = report["rotation"]
    assert isinstance(rotation, dict)
    # At step 5 long was suspended (late in the slot) and other held: both back in place after the raise.
    assert rotation["raised"] == {"step": 5, "running_kept": True, "waiting_kept": True}
