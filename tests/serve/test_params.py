"""A request body read strictly (``lora_pin.serve.params``), below HTTP: defaults, the harmless values of
parameters the server does not implement, and each refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from lora_pin.serve.params import InvalidParameter, SamplingParams, read_params


def _read(chat: bool = False, **body: Any) -> Any:
    return read_params(body, chat=chat, vocab=128)


def test_nulls_and_absent_fields_are_the_defaults() -> None:
    nulls = _read(n=None, max_tokens=None, temperature=None, top_p=None, seed=None, stream=None, stop=None)
    assert nulls == _read()
    assert nulls.n == 1 and nulls.max_tokens is None and not nulls.stream
    assert nulls.sampling == SamplingParams(temperature=1.0)


def test_harmless_values_of_unimplemented_parameters_are_accepted() -> None:
    read = _read(
        presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, logit_bias={}, echo=False,
        suffix="", best_of=2, n=2, user="u",
    )  # fmt: skip
    assert read.n == 2
    chat = _read(chat=True, tools=[], tool_choice="none", response_format={"type": "text"}, top_logprobs=0)
    assert chat.sampling.logprobs is None


def test_sampling_fields_and_per_choice_seeds() -> None:
    read = _read(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1, seed=41, n=3, logprobs=2)
    assert read.sampling == SamplingParams(0.5, 0, 0.9, 0.1, 41, 2)
    assert [read.sampling_of(j).seed for j in range(3)] == [41, 42, 43]
    assert _read(temperature=0).sampling.greedy and _read(top_k=1).sampling.greedy
    assert not _read().sampling.greedy
    assert _read(chat=True, logprobs=True, top_logprobs=4).sampling.logprobs == 4
    assert _read(chat=True, logprobs=True).sampling.logprobs == 0
    assert _read(stop="x").stop == ("x",) and _read(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)
    assert _read(chat=True, max_completion_tokens=3, max_tokens=9).max_tokens == 3


@pytest.mark.parametrize(
    ("chat", "field", "value"),
    [
        (False, "stream", 1),
        (False, "ignore_eos", "true"),
        (False, "temperature", True),
        (False, "temperature", float("nan")),
        (False, "temperature", 2.5),
        (False, "top_p", 0),
        (False, "min_p", -0.1),
        (False, "top_k", -2),
        (False, "n", 17),
        (False, "seed", 2**64),
        (False, "stop", ["a", "b", "c", "d", "e"]),
        (False, "stop", [""]),
        (False, "stop_token_ids", [128]),
        (False, "logprobs", True),
        (False, "best_of", 2),
        (False, "stream_options", {"include_usage": True}),
        (True, "logprobs", 1),
        (True, "top_logprobs", 3),
        (True, "tool_choice", "auto"),
        (True, "audio", {}),
        (True, "echo", False),
        (False, "messages", []),
    ],
)
def test_each_refusal_names_its_field(chat: bool, field: str, value: Any) -> None:
    with pytest.raises(InvalidParameter) as e:
        _read(chat=chat, **{field: value})
    assert e.value.param == field
