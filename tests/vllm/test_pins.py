"""Pins in ``vllm serve`` through the plugin: a start-up pin from ``--lora-modules`` (``"pinned": true``),
the pin and unpin endpoints, ``pinned`` on the load endpoint, the refusal of a pin that would leave no
slot, and admission under churn (more adapters than slots, one slot pinned): every answer equals PEFT's
and the engine never runs out of slots (vLLM's own scheduler fills ``--max-loras`` without counting
pins)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_harness import Oracle, VllmServer, prompt

# Three slots: one pinned at start-up, one more may be pinned, the third is left for the others.
SERVER_ARGS = ("--max-loras", "3", "--max-cpu-loras", "5", "--max-lora-rank", "8", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def server(make_server: Callable[..., VllmServer]) -> VllmServer:
    return make_server(True, *SERVER_ARGS, pinned=["ad1"])


def pin(server: VllmServer, name: str, pinned: bool = True) -> tuple[int, object]:
    return server.http(f"/v1/{'pin' if pinned else 'unpin'}_lora_adapter", "POST", {"lora_name": name})


def churn(server: VllmServer, oracle: Oracle, names: list[str], rounds: int = 2) -> list[tuple]:
    """Each adapter of ``names`` asked ``rounds`` prompts, all at once: the answers that differ from
    PEFT's, or failed."""
    wrong: list[tuple] = []

    def one(name: str, i: int) -> None:
        try:
            got = server.complete(name, prompt(i), 8)
        except Exception as e:
            wrong.append((name, i, repr(e)))
            return
        if got != oracle.tokens(server.dirs[name], prompt(i), 8):
            wrong.append((name, i, got))

    for name in names:
        for i in range(rounds):
            oracle.tokens(server.dirs[name], prompt(i), 8)
    threads = [threading.Thread(target=one, args=(n, i), daemon=True) for n in names for i in range(rounds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return wrong


def test_the_scheduler_and_the_start_up_pin_are_in_place(server: VllmServer) -> None:
    log = server.log.read_text(errors="replace")
    assert "lora_pin.vllm.Scheduler" in log
    # ad1 is pinned already: pinning it again changes nothing and is not refused.
    assert pin(server, "ad1")[0] == 200


def test_a_pin_that_would_leave_no_slot_is_refused_and_changes_nothing(server: VllmServer) -> None:
    assert pin(server, "ad2")[0] == 200
    status, body = pin(server, "ad3")
    assert status == 409
    assert "leave no slot" in json.dumps(body)
    # Nothing changed: unpinning ad3 is a no-op, ad2 stays pinned until unpinned.
    assert pin(server, "ad3", False)[0] == 200
    assert pin(server, "ad2", False)[0] == 200
    assert pin(server, "ad3")[0] == 200
    assert pin(server, "ad3", False)[0] == 200


def test_unknown_adapters_and_bad_bodies_are_refused(server: VllmServer) -> None:
    assert pin(server, "nope")[0] == 404
    assert server.http("/v1/pin_lora_adapter", "POST", {"lora_name": 5})[0] == 400
    assert server.http("/v1/pin_lora_adapter", "POST", {"lora_name": "ad1", "pinned": "yes"})[0] == 400


def test_under_churn_of_seven_adapters_over_three_slots_every_answer_equals_peft(
    server: VllmServer, oracle: Oracle
) -> None:
    assert churn(server, oracle, [f"ad{i}" for i in range(1, 8)]) == []
    # The pinned adapter's slot survived: its requests still equal PEFT's after the churn.
    assert churn(server, oracle, ["ad1"], rounds=1) == []


def test_the_load_endpoint_pins_with_pinned(server: VllmServer, oracle: Oracle, tmp_path: Path) -> None:
    status, body = server.http(
        "/v1/load_lora_adapter",
        "POST",
        {"lora_name": "late", "lora_path": str(server.dirs["ad5"]), "pinned": True},
    )
    assert status == 200, body
    # Two pins now (ad1 and late): a third would leave no slot.
    assert pin(server, "ad2")[0] == 409
    assert server.complete("late", prompt(3), 8) == oracle.tokens(server.dirs["ad5"], prompt(3), 8)
    assert pin(server, "late", False)[0] == 200
    assert pin(server, "ad2")[0] == 200
    assert pin(server, "ad2", False)[0] == 200
