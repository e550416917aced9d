"""``vllm serve`` with the plugin and rotation on (``LORA_PIN_VLLM_ROTATE=1``): more adapters than slots,
sent at once, every completion equals PEFT's greedy tokens, also a long stream suspended and resumed many
times; a later adapter's request is answered while an earlier long stream still runs (draining would
make it wait for the whole stream); a pinned adapter is never suspended (the scheduler logs every change
of the suspended adapters)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_harness import CALL_S, EOS, Oracle, VllmServer, concurrent_mix, prompt, wait_for

from lora_pin._testing import PeftOracle

# Two slots, ad1 pinned at start-up: one slot for the six others.
SERVER_ARGS = ("--max-loras", "2", "--max-cpu-loras", "8", "--max-lora-rank", "8", "--max-num-seqs", "32")
# lora_pin.vllm.scheduler's switches (that module imports vLLM, which this venv has not).
ROTATION = {"LORA_PIN_VLLM_ROTATE": "1", "LORA_PIN_VLLM_AGE_BOUND": "2"}
LONG = 1900  # tokens of the request the later adapter's must not wait for
LATE = 200  # tokens of the later adapter's request
SUSPENDS = re.compile(r"lora_pin rotation: step \d+ suspends the running requests of adapters \[(.*)\]")


@pytest.fixture(scope="module")
def server(make_server: Callable[..., VllmServer]) -> VllmServer:
    return make_server(True, *SERVER_ARGS, pinned=["ad1"], env=ROTATION)


def suspended_adapters(server: VllmServer, since: int = 0) -> set[str]:
    """Every adapter the scheduler has suspended running requests of so far (or in the log past its
    first ``since`` characters), from its log."""
    names: set[str] = set()
    for match in SUSPENDS.finditer(server.log.read_text(errors="replace")[since:]):
        names.update(n.strip().strip("'") for n in match.group(1).split(",") if n.strip())
    return names


def test_base_and_seven_adapters_at_once_equal_peft(server: VllmServer, oracle: Oracle) -> None:
    # 24 requests over the base and 7 adapters, one unpinned slot, under the rotating scheduler: every
    # answer is still PEFT's. Whether a request here waits long enough to suspend another depends on
    # when the client's requests arrive; the next test makes the engine suspend one for sure.
    assert concurrent_mix(server, oracle, max_tokens=16) == []


def running_requests(server: VllmServer) -> float:
    """vLLM's count of running requests (suspended ones included: they stay in its running list), from
    ``/metrics``."""
    status, text = server.http("/metrics")
    assert status == 200, text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    ]
    assert values, "no vllm:num_requests_running in /metrics"
    return sum(values)


class Completion:
    """A greedy completion (EOS ignored) posted from a thread at construction (a bare HTTP request: no
    client to build first, so it reaches the server at once); :meth:`tokens` joins it and returns its
    token ids. Not streamed: reading a long stream token by token keeps a busy test process (and its
    polls of ``/metrics``) far behind the engine."""

    def __init__(self, server: VllmServer, model: str, ids: list[int], max_tokens: int) -> None:
        body = dict(model=model, prompt=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self._answer: list[tuple[int, object]] = []
        self._failed: list[BaseException] = []

        def run() -> None:
            try:
                self._answer.append(
                    server.http("/v1/completions", "POST", {**body, "return_token_ids": True})
                )
            except BaseException as e:
                self._failed.append(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        """Whether it still runs; fails with its error if it failed."""
        assert not self._failed, self._failed
        return self.thread.is_alive()

    def tokens(self) -> list[int]:
        self.thread.join(CALL_S)
        assert not self.thread.is_alive(), "the completion did not end"
        assert not self._failed, self._failed
        status, body = self._answer[0]
        assert status == 200 and isinstance(body, dict), (status, body)
        return list(body["choices"][0]["token_ids"])


def peft_would_choose(oracle: PeftOracle, adapter_dir: Path, ids: list[int], tokens: list[int]) -> bool:
    """Whether ``tokens`` are PEFT's greedy tokens after ``ids`` (no stop at EOS): at every position the
    token PEFT's logits rank first, given the tokens before it (one forward over all of them)."""
    chosen = oracle.log_softmax(ids, adapter_dir, tokens).argmax(dim=-1).tolist()
    return bool(chosen == tokens)


def test_a_later_adapter_runs_before_a_long_request_has_finished(
    server: VllmServer, vllm_world: tuple[Path, dict[str, Path]]
) -> None:
    # ad2 takes the one unpinned slot for LONG tokens; once the server reports it running, ad3 asks for
    # LATE. Draining, ad3 would wait until ad2 finished and nothing would ever be suspended. Rotating, ad3
    # takes ad2's slot a few steps after it came and the two alternate: the scheduler's log names ad2 as
    # suspended (a running request, not finished, sitting out while ad3 runs) and ad3 in turn. Decided from
    # the server's log, not from when the client threads see their answers (that races ad2's last tokens).
    assert running_requests(server) == 0
    since = len(server.log.read_text(errors="replace"))
    long = Completion(server, "ad2", prompt(6), LONG)
    wait_for("ad2 running", lambda: long.alive() and running_requests(server) == 1, every=0.02)
    late = Completion(server, "ad3", prompt(8), LATE)
    late_tokens = late.tokens()
    assert {"ad2", "ad3"} <= suspended_adapters(server, since)
    # Suspended and resumed, the answers are still PEFT's greedy tokens, token for token (without a
    # stop at EOS).
    peft = PeftOracle(vllm_world[0], EOS)
    assert peft_would_choose(peft, server.dirs["ad3"], prompt(8), late_tokens)
    assert peft_would_choose(peft, server.dirs["ad2"], prompt(6), long.tokens())


def test_a_pinned_adapter_is_never_suspended(server: VllmServer) -> None:
    # After the tests above (ad1 pinned, running beside the rotation): the log never names it.
    assert "lora_pin.vllm.Scheduler" in server.log.read_text(errors="replace")
    assert suspended_adapters(server)
    assert "ad1" not in suspended_adapters(server)
