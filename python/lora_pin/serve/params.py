"""A request body read strictly: every parameter ``lora-pin serve`` honours, checked, and every one it
does not implement refused by name.

The rules, the same for both endpoints:

- ``null`` (or an absent field) means the parameter's default;
- a field of the wrong type is refused (a string is not a boolean, a float is not an integer, ``true`` is
  not a number); a number out of its range is refused;
- a parameter the server does not implement is refused when it asks for something (a non-zero penalty,
  a non-empty ``logit_bias``, ``echo: true`` ...) and accepted when it asks for what the server does
  anyway (``presence_penalty: 0``, ``logit_bias: {}``, ``best_of`` equal to ``n``);
- a field the server does not know is refused: answering as if it had not been sent would be answering
  another question.

Every refusal is an :class:`InvalidParameter` naming the parameter (400 ``param`` in OpenAI's shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP",
    "InvalidParameter",
    "RequestParams",
    "SamplingParams",
    "read_params",
]

# vLLM's bound on logprobs per token (OpenAI's chat bound too).
MAX_LOGPROBS = 20
# Choices per request: each is a request of its own in the engine.
MAX_N = 16
# Stop strings per request (OpenAI's bound).
MAX_STOP = 4
_MAX_STOP_CHARS = 256
_MAX_STOP_TOKEN_IDS = 64
_SEED_RANGE = (-(2**63), 2**64 - 1)

# Fields a client may send that change nothing in the answer: bookkeeping for the client or the caller.
_ACCEPTED_METADATA = frozenset({"user", "metadata", "service_tier", "store", "parallel_tool_calls"})
# The fields each endpoint reads (besides the metadata above).
_COMMON = frozenset(
    {
        "model",
        "lora_path",
        "max_tokens",
        "n",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "return_token_ids",
        "logprobs",
        # Refused unless they ask for nothing (checked one by one below).
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "best_of",
    }
)
_COMPLETION = _COMMON | {"prompt", "echo", "suffix"}
_CHAT = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
}


class InvalidParameter(ValueError):
    """A request parameter the server refuses; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one choice's tokens are picked, per token, from the logits its adapter's row produced.

    Attributes:
        temperature: 0 is greedy (argmax, the engine's own pick); above 0 the logits are divided by it
            and a token drawn from the softmax after ``top_k``, ``top_p`` and ``min_p``.
        top_k: keep the ``top_k`` most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probabilities sum to ``top_p`` (1: all).
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's (0: none).
        seed: the seed of this choice's own random generator (None: a random one), so its tokens depend
            on its seed, prompt and adapter only, never on what else shares the batch.
        logprobs: None: no log-probabilities; k >= 0: the chosen token's and the ``k`` most likely ones',
            ``log_softmax`` of the row's logits before any of the above.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """Whether the engine's argmax picks the tokens (temperature 0, or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class RequestParams:
    """What one completion or chat request asks for, checked (:func:`read_params`).

    Attributes:
        max_tokens: the output limit asked for (None: the room left in the context).
        n: choices.
        stream: whether the answer is streamed; ``include_usage``: the last chunk carries usage.
        sampling: the first choice's sampling (choice i's seed is ``seed + i``).
        stop: strings that end a choice (its text ends before them; ``finish_reason`` "stop").
        stop_token_ids: token ids that end a choice (the token is kept, as an end-of-sequence token is).
        ignore_eos: generate past the end-of-sequence token (load tests).
        return_token_ids: vLLM's field: each choice carries its token ids.
    """

    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    return_token_ids: bool

    def sampling_of(self, choice: int) -> SamplingParams:
        """Choice ``choice``'s sampling: its seed is the request's plus ``choice`` (None stays None)."""
        seed = self.sampling.seed
        if seed is None or choice == 0:
            return self.sampling
        return SamplingParams(**{**vars(self.sampling), "seed": seed + choice})


def _present(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is not None


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParameter(name, f"{name} must be true or false (got {value!r})")
    return value


def _int(body: dict[str, Any], name: str, low: int, high: int | None, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, f"{name} must be an integer (got {value!r})")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"from {low} to {high}"
        raise InvalidParameter(name, f"{name} must be {bound} (got {value})")
    return value


def _float(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParameter(name, f"{name} must be a number (got {value!r})")
    if not low <= value <= high:
        raise InvalidParameter(name, f"{name} must be from {low:g} to {high:g} (got {value})")
    return float(value)


def _refuse_unless(body: dict[str, Any], name: str, harmless: Any) -> None:
    """Refuses ``name`` unless it is absent, null, or asks for nothing (``harmless(value)``)."""
    value = body.get(name)
    if value is not None and not harmless(value):
        raise InvalidParameter(name, f"{name} is not supported by this server (got {value!r})")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidParameter("stop", f"stop must be a string or a list of strings (got {value!r})")
    if len(stops) > MAX_STOP:
        raise InvalidParameter("stop", f"stop takes at most {MAX_STOP} strings (got {len(stops)})")
    if any(not s or len(s) > _MAX_STOP_CHARS for s in stops):
        raise InvalidParameter("stop", f"each stop string must have 1 to {_MAX_STOP_CHARS} characters")
    return tuple(stops)


def _stop_token_ids(body: dict[str, Any], vocab: int) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or len(value) > _MAX_STOP_TOKEN_IDS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)
    ):
        raise InvalidParameter(
            "stop_token_ids",
            f"stop_token_ids must be a list of at most {_MAX_STOP_TOKEN_IDS} token ids below {vocab}",
        )
    return tuple(value)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Completions: ``logprobs`` is the number of top tokens (0..20). Chat: ``logprobs`` is a boolean and
    ``top_logprobs`` the number (0..20, only with ``logprobs``)."""
    if not chat:
        return _int(body, "logprobs", 0, MAX_LOGPROBS, None)
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS, None)
    if top and not wanted:
        raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not set(options) <= {"include_usage", "continuous_usage_stats"}:
        raise InvalidParameter(
            "stream_options", f"stream_options must be an object with include_usage (got {options!r})"
        )
    if not stream:
        raise InvalidParameter("stream_options", "stream_options is only allowed with stream: true")
    if options.get("continuous_usage_stats") not in (None, False):
        raise InvalidParameter("stream_options", "continuous_usage_stats is not supported by this server")
    return _bool(options, "include_usage")


def read_params(body: dict[str, Any], *, chat: bool, vocab: int) -> RequestParams:
    """The parameters of ``body`` (a completion's, or with ``chat`` a chat completion's), checked.

    ``vocab``: token ids must be below it (``stop_token_ids``).

    Raises:
        InvalidParameter: a field of the wrong type, out of range, not implemented or unknown; its
            ``param`` names the field.
    """
    known = _CHAT if chat else _COMPLETION
    for name in body:
        if name not in known and name not in _ACCEPTED_METADATA:
            raise InvalidParameter(name, f"unknown parameter {name!r}: this server does not implement it")
    for name in ("presence_penalty", "frequency_penalty"):
        _refuse_unless(body, name, lambda v: v == 0 and not isinstance(v, bool))
    _refuse_unless(body, "repetition_penalty", lambda v: v == 1 and not isinstance(v, bool))
    _refuse_unless(body, "logit_bias", lambda v: v == {})
    _refuse_unless(body, "echo", lambda v: v is False)
    _refuse_unless(body, "suffix", lambda v: v == "")
    for name in ("tools", "functions"):
        _refuse_unless(body, name, lambda v: v == [])
    for name in ("tool_choice", "function_call"):
        _refuse_unless(body, name, lambda v: v == "none")
    _refuse_unless(body, "response_format", lambda v: v == {"type": "text"})
    _refuse_unless(body, "modalities", lambda v: v == ["text"])
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        _refuse_unless(body, name, lambda v: False)
    n = _int(body, "n", 1, MAX_N, 1)
    assert n is not None
    _refuse_unless(body, "best_of", lambda v: v == n and not isinstance(v, bool))
    limit_name = "max_completion_tokens" if chat and _present(body, "max_completion_tokens") else "max_tokens"
    max_tokens = _int(body, limit_name, 1, None, None)
    stream = _bool(body, "stream")
    seed = _int(body, "seed", _SEED_RANGE[0], _SEED_RANGE[1], None)
    sampling = SamplingParams(
        temperature=_float(body, "temperature", 0.0, 2.0, 1.0),
        top_k=_top_k(body),
        top_p=_float(body, "top_p", 0.0, 1.0, 1.0),
        min_p=_float(body, "min_p", 0.0, 1.0, 0.0),
        seed=seed,
        logprobs=_logprobs(body, chat),
    )
    if sampling.top_p == 0.0:
        raise InvalidParameter("top_p", "top_p must be above 0 (it would keep no token)")
    return RequestParams(
        max_tokens=max_tokens,
        n=n,
        stream=stream,
        include_usage=_stream_options(body, stream),
        sampling=sampling,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body, vocab),
        ignore_eos=_bool(body, "ignore_eos"),
        return_token_ids=_bool(body, "return_token_ids"),
    )


def _top_k(body: dict[str, Any]) -> int:
    """``top_k``: -1 and 0 keep every token (vLLM's -1, transformers' 0)."""
    value = _int(body, "top_k", -1, None, 0)
    assert value is not None
    return max(0, value)
