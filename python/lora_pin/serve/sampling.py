"""Per-request sampling and log-probabilities inside transformers' continuous-batching engine.

The engine (transformers 5.24) samples every row of a step with one ``torch.multinomial`` over one
global generator, or takes the argmax of every row: which, is fixed for the whole engine
(``GenerationConfig.do_sample``). Its per-request processors (``per_request_processors``) vary
temperature, top-k and top-p per request, but not greedy versus sampled, not the seed, and its
log-probabilities are the chosen token's only. So lora_pin leaves the engine greedy and installs one
processor of its own (:class:`RowSampler`, a ``ContinuousBatchingLogitsProcessor``, the engine's class
for per-request processing): for each row of a step it

- records the log-probabilities a request asked for, ``log_softmax`` of the row's logits as the model
  (with the row's adapter) produced them;
- leaves a greedy row's logits untouched, so the engine's argmax picks exactly the token it always did;
- draws a sampled row's token with the request's own generator (seeded by the request's ``seed``) and
  hands the engine logits whose only finite entry is that token, which its argmax then picks.

A request's tokens thus depend on its seed, its prompt and its adapter only, never on what shares its
batch (beyond floating-point rounding of the logits themselves).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lora_pin.serve.params import SamplingParams

__all__ = ["RowSampler", "TokenLogprobs"]

_SEED_MODULUS = 2**64


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probabilities: its own and the ``k`` most likely tokens' (``top``, most
    likely first, as ``(token id, logprob)``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class _Track:
    params: SamplingParams
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def _as_processor_base() -> type[Any]:
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
    )

    return ContinuousBatchingLogitsProcessor


class RowSampler(_as_processor_base()):  # type: ignore[misc]
    """The engine's one logits processor: per-request sampling and log-probabilities (module docs).

    Requests are registered (:meth:`register`) before they are submitted and forgotten
    (:meth:`forget`) once done; an unregistered request is greedy without log-probabilities.
    Thread safety: :meth:`register`, :meth:`forget` and :meth:`logprobs` run on any thread; the engine's
    calls (:meth:`prepare_tensor_args`, ``__call__``) on its own, one step after the other (the engine
    runs without asynchronous batching, so a step's rows are those prepared last).
    """

    # The engine's per-request keyword arguments: none (lora_pin keeps each request's own parameters).
    supported_kwargs: ClassVar[dict[str, type]] = {}
    ignored_kwargs: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._rows: list[_Track | None] = []
        self.tokens_generated = 0  # every row of every step so far: the engine's output tokens

    # ---- the server's side ------------------------------------------------------------------------

    def register(self, request_id: str, params: SamplingParams) -> None:
        """Sample ``request_id``'s tokens by ``params`` (nothing to do for greedy without logprobs)."""
        if params.greedy and params.logprobs is None:
            return
        with self._lock:
            self._tracks[request_id] = _Track(params)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s generator and log-probabilities (unknown: nothing)."""
        with self._lock:
            self._tracks.pop(request_id, None)

    def logprobs(self, request_id: str, start: int, stop: int) -> list[TokenLogprobs]:
        """The log-probabilities of ``request_id``'s generated tokens ``start`` to ``stop`` (those the
        engine has delivered: each is recorded before its token is)."""
        with self._lock:
            track = self._tracks.get(request_id)
            return [] if track is None else track.logprobs[start:stop]

    # ---- the engine's side ------------------------------------------------------------------------

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        """Notes which request each of the step's logits rows is (rows in this order)."""
        with self._lock:
            self._rows = [self._tracks.get(r.state.request_id) for r in requests_with_new_token]
            self.tokens_generated += len(requests_with_new_token)
        return torch.arange(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        """``scores``: float32 ``[rows, vocab]``, the step's logits: first the rows of the requests with a
        new token, in the order :meth:`prepare_tensor_args` saw them, then one row (unused) per other
        request of the batch (a prompt part-way through its prefill). Returns them with every sampled
        row's set to -inf but at its drawn token (0 there); greedy rows are returned as they are."""
        rows = self._rows
        if not any(rows):
            return scores
        if len(rows) > scores.size(0):
            raise RuntimeError(f"lora_pin's sampler expected {len(rows)} logits rows, got {scores.size(0)}")
        out = scores
        for i, track in enumerate(rows):
            if track is None:
                continue
            row = scores[i]
            params = track.params
            if params.greedy:
                token = int(torch.argmax(row))
            else:
                token = self._draw(track, row)
                if out is scores:
                    out = scores.clone()
                out[i].fill_(float("-inf"))
                out[i, token] = 0.0
            if params.logprobs is not None:
                track.logprobs.append(_logprobs_of(row, token, params.logprobs))
        return out

    @staticmethod
    def _draw(track: _Track, row: torch.Tensor) -> int:
        """One token from ``row`` (float32 ``[vocab]``) by the track's temperature, top-k, top-p and
        min-p, with its own generator."""
        params = track.params
        if track.generator is None:
            seed = random.getrandbits(63) if params.seed is None else params.seed % _SEED_MODULUS
            track.generator = torch.Generator(device=row.device)
            track.generator.manual_seed(seed)
        logits = row / params.temperature
        if 0 < params.top_k < logits.numel():
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep each token whose more likely predecessors sum to less than top_p (the first always).
            drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if params.min_p > 0.0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=track.generator))


def _logprobs_of(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(row, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token, float(logprobs[token]), top)
