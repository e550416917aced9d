"""The HTTP face of ``lora-pin serve``: OpenAI-compatible endpoints and the peers' adapter endpoints.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's, streaming or not; ``model`` names
  the base, an adapter (vLLM) or ``base:adapter`` (SGLang); SGLang's ``lora_path`` field too; vLLM's
  ``return_token_ids``, ``ignore_eos``, ``top_k``, ``min_p`` and ``stop_token_ids``. Sampling, seeds,
  ``n``, stop strings and log-probabilities per request; every parameter the server does not implement
  is refused by name (:mod:`lora_pin.serve.params` has the rules);
- ``POST /v1/tokenize``, ``/v1/detokenize``: vLLM's;
- ``GET /v1/models``: the base and every adapter, with vLLM's ``root`` and ``parent``;
- ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``: vLLM's bodies, status codes, messages;
- ``POST /load_lora_adapter``, ``/unload_lora_adapter``: SGLang's, ``{success, error_message,
  loaded_adapters}``;
- ``POST /v1/pin_lora_adapter``, ``/v1/unpin_lora_adapter``: ``{lora_name}``, in vLLM's shapes;
- ``GET /health`` (200 while the engine's thread runs, 503 if not), ``GET /metrics`` (Prometheus text),
  ``GET /version``.

A request whose client goes away before its answer (a closed stream, a timeout, a dropped connection) is
cancelled in the engine (:meth:`~lora_pin.serve.engine.LoRAEngine.cancel`): its KV-cache pages and its
adapter's count are released and nothing of it stays behind. At most ``max_queued_requests`` requests wait
for the engine to start them; past that a new one is refused at once with 503 and ``Retry-After``
(SGLang's ``--max-queued-requests``, its status and message), so a flood cannot grow the server's memory.

The adapter endpoints exist only with ``allow_runtime_updates`` (as vLLM's exist only when runtime
updating is allowed): without it they are 404. With ``api_key`` every endpoint but ``/health``,
``/metrics`` and ``/version`` needs ``Authorization: Bearer <key>`` (401 ``{"error": "Unauthorized"}``
otherwise, vLLM's answer); with ``api_key_all_endpoints`` those too. Errors are OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``. Bodies past ``max_body_bytes`` are 413, malformed JSON
400; the server goes on.

A request holds a :class:`~lora_pin.serve.adapters.Lease` on its adapter from the moment it is counted;
the lease passes at once to the request's flight, which releases it however the request ends (answered,
failed, cancelled, refused by the engine): nothing that can raise runs between the two.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from lora_pin import __version__
from lora_pin.errors import AdapterNotFoundError, DuplicateAdapterError, LoraPinError
from lora_pin.serve import DEFAULT_MAX_QUEUED_REQUESTS
from lora_pin.serve.adapters import AdapterAdmin, AdapterBusyError, Lease
from lora_pin.serve.naming import UnknownModelError, requested_adapter
from lora_pin.serve.params import InvalidParameter, RequestParams, read_params
from lora_pin.serve.sampling import TokenLogprobs

if TYPE_CHECKING:
    from lora_pin.serve.engine import LoRAEngine
    from lora_pin.serve.metrics import ServeMetrics

__all__ = ["DEFAULT_MAX_BODY_BYTES", "MAX_PROMPTS", "QUEUE_FULL_RETRY_AFTER_S", "ServerState", "build_app"]

DEFAULT_MAX_BODY_BYTES = 4 << 20
# The ``Retry-After`` of a refusal for a full queue: a step or a few free room.
QUEUE_FULL_RETRY_AFTER_S = 1


@dataclass
class ServerState:
    """Everything the endpoints share.

    Attributes:
        engine: the continuous-batching engine.
        tokenizer: the base model's tokenizer (a chat template for ``/v1/chat/completions``).
        admin: the adapters' state and requests.
        metrics: the ``/metrics`` registry.
        base_name: the base model's name in requests and ``/v1/models``.
        max_model_len: the longest prompt plus output a request may ask for, in tokens.
        api_key: the key requests must bear (None: none).
        api_key_all_endpoints: the key guards ``/health``, ``/metrics`` and ``/version`` too (otherwise
            only the API: probes and scrapers need no key, as with vLLM).
        allow_runtime_updates: whether the adapter endpoints exist.
        max_body_bytes: the largest request body.
        default_max_tokens: a request's output limit when it sets none, at most the room left in the
            context (None: the room left).
        max_queued_requests: the most requests waiting for the engine to start them; past it, 503.
        chat_template: the chat template (Jinja) to use instead of the tokenizer's (None: its own).
    """

    engine: LoRAEngine
    tokenizer: Any
    admin: AdapterAdmin
    metrics: ServeMetrics
    base_name: str
    max_model_len: int
    api_key: str | None = None
    api_key_all_endpoints: bool = False
    allow_runtime_updates: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int | None = None
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    chat_template: str | None = None


class HTTPError(Exception):
    """An answer in OpenAI's error shape (``headers``: extra response headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "BadRequestError",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers


def _error(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Any:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


# Paths a key does not guard unless ``api_key_all_endpoints``: health probes, scrapers, version checks.
_OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
# Prompts one completion request may list (each with ``n`` choices).
MAX_PROMPTS = 64


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state`` (run it with uvicorn)."""
    app = FastAPI(title="lora-pin serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        guarded = state.api_key_all_endpoints or request.url.path not in _OPEN_PATHS
        if (
            guarded
            and state.api_key is not None
            and request.headers.get("authorization") != f"Bearer {state.api_key}"
        ):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > state.max_body_bytes):
            return _error(413, f"request body over {state.max_body_bytes} bytes", "RequestTooLarge")
        return await call_next(request)

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError) -> Any:
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    async def body_of(request: Request) -> dict[str, Any]:
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > state.max_body_bytes:
                raise HTTPError(413, f"request body over {state.max_body_bytes} bytes", "RequestTooLarge")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    @app.get("/health")
    async def health() -> Any:
        if not state.engine.is_alive():
            return _error(503, "the engine's generation thread is not running", "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Any:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Any:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Any:
        created = int(time.time())
        data = [_model_card(state.base_name, state.base_name, None, created, state.max_model_len)]
        data += [
            _model_card(n, path, state.base_name, created, state.max_model_len)
            for n, path in state.admin.served().items()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        prompts = _prompts(state, body.get("prompt"))
        return await _answer(request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await body_of(request)
        return await _answer(request, body, [_chat_prompt(state, body)], chat=True)

    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await body_of(request)
        _adapter_of(state, body)  # a model that is not served is 404, as for a completion
        if "messages" in body:
            ids = _chat_prompt(state, body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise HTTPError(400, "prompt must be a string (or give messages)", param="prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise HTTPError(400, "add_special_tokens must be true or false", param="add_special_tokens")
            ids = list(state.tokenizer(prompt, add_special_tokens=special)["input_ids"])
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> Any:
        body = await body_of(request)
        _adapter_of(state, body)
        tokens = body.get("tokens")
        if not _token_ids(state, tokens, allow_empty=True):
            raise HTTPError(400, f"tokens must be a list of token ids below {len(state.tokenizer)}", "tokens")
        return {"prompt": state.tokenizer.decode(tokens)}

    async def _answer(request: Request, body: dict[str, Any], prompts: list[list[int]], chat: bool) -> Any:
        try:
            params = read_params(body, chat=chat, vocab=len(state.tokenizer))
        except InvalidParameter as e:
            raise HTTPError(400, str(e), param=e.param) from e
        if len(prompts) * params.n > MAX_PROMPTS:
            raise HTTPError(400, f"prompts times n must be at most {MAX_PROMPTS}", param="n")
        adapter = _adapter_of(state, body)
        limits = [_max_tokens(state, params.max_tokens, len(p)) for p in prompts]
        if state.engine.stats().queued >= state.max_queued_requests:
            state.metrics.count(adapter, "refused")
            raise HTTPError(
                503,
                "The request queue is full.",
                "ServiceUnavailable",
                headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
            )
        answer = _Answer(state, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, body, params, chat)
        flight = _Flight(state, answer)
        # The lease goes straight into the flight, which releases it however the request ends.
        flight.lease = await state.admin.acquire(adapter)
        if flight.lease is None:
            raise HTTPError(404, UnknownModelError(str(body.get("model"))).args[0], "NotFoundError", "model")
        try:
            flight.submit(prompts, limits)
            if params.stream:
                return _Stream(answer.stream(flight), flight)
        except BaseException:
            flight.close()
            raise
        try:
            return await _unless_disconnected(answer.whole(flight), request)
        finally:
            flight.close()

    if state.allow_runtime_updates:
        _adapter_routes(app, state, body_of)
    return app


def _model_card(name: str, root: str, parent: str | None, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "lora_pin",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }


def _adapter_of(state: ServerState, body: dict[str, Any]) -> str | None:
    try:
        return requested_adapter(
            body.get("model"), body.get("lora_path"), state.base_name, state.admin.serves
        )
    except UnknownModelError as e:
        raise HTTPError(404, e.args[0], "NotFoundError", "model") from e
    except TypeError as e:
        raise HTTPError(400, str(e), param="model") from e


def _token_ids(state: ServerState, ids: Any, allow_empty: bool = False) -> bool:
    vocab = len(state.tokenizer)
    return (
        isinstance(ids, list)
        and (allow_empty or bool(ids))
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
    )


def _prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """A completion's prompts as token ids: a string, a list of ids, or a list of either (each one a
    prompt of its own, answered by its own choices)."""
    if isinstance(prompt, str) or _token_ids(state, prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        prompts = [None]
    if len(prompts) > MAX_PROMPTS:
        raise HTTPError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    out = []
    for p in prompts:
        if isinstance(p, str) and p:
            out.append(list(state.tokenizer(p, add_special_tokens=False)["input_ids"]))
        elif _token_ids(state, p):
            out.append(list(p))
        else:
            raise HTTPError(
                400,
                f"prompt must be a non-empty string or list of token ids below {len(state.tokenizer)}, or a "
                "list of such prompts",
                param="prompt",
            )
    return out


def _chat_prompt(state: ServerState, body: dict[str, Any]) -> list[int]:
    """The chat template applied to ``messages``, with the assistant's turn begun."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", param="messages")
    try:
        ids = state.tokenizer.apply_chat_template(
            messages, chat_template=state.chat_template, add_generation_prompt=True, tokenize=True
        )
    except Exception as e:  # the template's own errors: a message without role or content, say
        raise HTTPError(400, f"messages do not fit the chat template: {e}", param="messages") from e
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _max_tokens(state: ServerState, limit: int | None, prompt_len: int) -> int:
    """The output limit of a prompt of ``prompt_len`` tokens: ``limit``, or by default the room left in
    the context (at most ``default_max_tokens``)."""
    room = state.max_model_len - prompt_len
    if room < 1:
        raise HTTPError(
            400,
            f"the prompt's {prompt_len} tokens leave no room in the model's length {state.max_model_len}",
            param="prompt",
        )
    if limit is None:
        return room if state.default_max_tokens is None else min(state.default_max_tokens, room)
    if limit > room:
        raise HTTPError(
            400,
            f"the prompt's {prompt_len} tokens plus max_tokens {limit} exceed the model's length "
            f"{state.max_model_len}",
            param="max_tokens",
        )
    return limit


class _Choice:
    """One choice of a request: one request in the engine, its tokens, its text and how it ended."""

    def __init__(self, index: int, request_id: str, prompt: int, prompt_len: int) -> None:
        self.index, self.request_id, self.prompt, self.prompt_len = index, request_id, prompt, prompt_len
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] = []  # of its tokens so far, when asked for
        self.text = ""
        self.finish: str | None = None
        self.error: Any = None
        self.last: Any = None  # the engine's last output for it
        self.started = False  # a chunk of it was streamed
        self.submitted = False  # it went to the engine
        self.sent_tokens = 0
        self.sent_text = 0
        self.closed = False  # nothing more of it goes to the client (its stop string was seen)


class _Flight:
    """One request's choices in the engine, from their submission until the server lets them go
    (:meth:`close`); holds the request's lease on its adapter until then."""

    def __init__(self, state: ServerState, answer: _Answer) -> None:
        self.state, self.answer = state, answer
        self.lease: Lease | None = None  # set once the request is counted
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.choices: list[_Choice] = []
        # A prompt's first choice -> its other choices, queued once it has its first token.
        self._followers: dict[int, list[tuple[_Choice, list[int], int]]] = {}
        self._closed = False

    @property
    def held(self) -> Lease:
        """The request's lease (set before anything is submitted)."""
        assert self.lease is not None, "the flight was used before its request was counted"
        return self.lease

    def submit(self, prompts: list[list[int]], limits: list[int]) -> None:
        """Queue ``n`` choices of each prompt (choice ``p * n + j`` is prompt p's j-th).

        With prefix caching and a prompt of at least one whole KV page, a prompt's first choice goes
        alone, and the others once it has its first token: its prompt's blocks are in the cache by
        then, so theirs are shared rather than computed again.

        Raises:
            HTTPError: 503, the engine takes no requests now (it is starting again after an error).
        """
        n, engine = self.answer.params.n, self.state.engine
        for p, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
            for j in range(n):
                index = p * n + j
                self.choices.append(_Choice(index, f"{self.answer.request_id}-{index}", p, len(prompt)))
            later = n > 1 and engine.shares_prefix(len(prompt))
            self._submit(self.choices[p * n], prompt, limit, leads=later)
            if later:
                self._followers[p * n] = [(c, prompt, limit) for c in self.choices[p * n + 1 : p * n + n]]
            else:
                for choice in self.choices[p * n + 1 : p * n + n]:
                    self._submit(choice, prompt, limit)

    def _submit(self, choice: _Choice, prompt: list[int], limit: int, leads: bool = False) -> None:
        """Queue one choice; ``leads``: others wait for its first token (streamed to see it).

        Raises:
            HTTPError: 503, the engine takes no requests now.
        """
        params, engine = self.answer.params, self.state.engine
        engine.cb.register_result_handler(
            choice.request_id, lambda output, i=choice.index: self.queue.put_nowait((i, output))
        )
        choice.submitted = True
        try:
            engine.submit(
                choice.request_id,
                prompt,
                self.held.name,
                max_new_tokens=limit,
                # Stop strings are looked for as the tokens come, to end the choice there.
                streaming=params.stream or bool(params.stop) or leads,
                ignore_eos=params.ignore_eos,
                sampling=params.sampling_of(choice.index % params.n),
                stop_token_ids=params.stop_token_ids,
                prefix_key=self.held.digest,
            )
        except RuntimeError as e:
            engine.cb.output_router.result_handlers.pop(choice.request_id, None)
            choice.closed = True
            raise HTTPError(503, str(e), "ServiceUnavailable") from e

    def _release_followers(self, leader: int) -> None:
        """Queue the choices that waited for ``leader``'s first token (or its end)."""
        for choice, prompt, limit in self._followers.pop(leader, ()):
            try:
                self._submit(choice, prompt, limit)
            except HTTPError as e:
                choice.error = e.message

    async def outputs(self) -> AsyncIterator[_Choice]:
        """Each choice as it changes (its new tokens, its end), until every choice has ended. The flight
        stays open (its log-probabilities readable) until :meth:`close`, which its owner calls however
        the answer ends."""
        while not all(c.finish is not None or c.error is not None for c in self.choices):
            index, output = await self.queue.get()
            choice = self.choices[index]
            self._release_followers(index)
            if choice.closed:
                continue
            self.answer.update(choice, output)
            if choice.finish == "stop" and not output.is_finished():
                # Its stop string came: the engine need not go on with it.
                choice.closed = True
                self.state.engine.cancel(choice.request_id)
            yield choice

    def close(self) -> None:
        """Let the request go (again: nothing): its unfinished choices cancelled in the engine, its lease
        released."""
        if self._closed:
            return
        self._closed = True
        engine = self.state.engine
        gave_up = False
        for choice in self.choices:
            if choice.closed or not choice.submitted:
                continue
            if choice.last is not None and choice.last.is_finished():
                engine.done(choice.request_id)
            else:
                engine.cancel(choice.request_id)
                gave_up = True
        if self.lease is not None:
            if gave_up:
                self.state.metrics.count(self.lease.name, "cancelled")
            self.lease.release()


class _Stream(StreamingResponse):
    """A streamed answer that lets its request go however the response ends: the last chunk sent, the
    client gone (Starlette cancels the response then), or the body never started."""

    def __init__(self, content: AsyncIterator[str], flight: _Flight) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._flight = flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._flight.close()


async def _unless_disconnected(work: Awaitable[Any], request: Request) -> Any:
    """``work``'s result, or, should the client go away first, ``work`` cancelled and a 499 that no one
    reads. Starlette does not cancel a plain (not streamed) endpoint when its client goes away."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=499)
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is read already: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Answer:
    """One request's answer, whole or streamed, in OpenAI's completion or chat shape."""

    def __init__(
        self, state: ServerState, request_id: str, body: dict[str, Any], params: RequestParams, chat: bool
    ) -> None:
        self.state, self.request_id, self.params, self.chat = state, request_id, params, chat
        self.model = body.get("model") or state.base_name
        self.created = int(time.time())
        self.accepted = time.perf_counter()
        eos = state.engine.eos_token_id
        eos_ids = [] if eos is None or params.ignore_eos else [eos] if isinstance(eos, int) else list(eos)
        self.ends = {*eos_ids, *params.stop_token_ids}
        # Text that may still turn out to begin a stop string is held back from a stream.
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.recorded = False

    def _text(self, tokens: list[int]) -> str:
        return str(self.state.tokenizer.decode(tokens, skip_special_tokens=True))

    def update(self, choice: _Choice, output: Any) -> None:
        """Take the engine's latest ``output`` for ``choice``: its tokens and text, cut at the first stop
        string; its end."""
        choice.last = output
        if output.error is not None:
            choice.error = output.error
            return
        tokens = list(output.generated_tokens)
        if self.params.sampling.logprobs is not None:
            # Copied as the tokens come: the sampler forgets them with the request.
            sampler = self.state.engine.sampler
            choice.logprobs += sampler.logprobs(choice.request_id, len(choice.logprobs), len(tokens))
        text = self._text(tokens)
        if self.params.stop:
            # A stop string must end in the new text: look from where one could have begun.
            start = max(0, len(choice.text) - self.holdback)
            hits = [(i, s) for s in self.params.stop if (i := text.find(s, start)) >= 0]
            if hits:
                choice.tokens, choice.text = tokens, text[: min(hits)[0]]
                choice.finish = "stop"
                return
        choice.tokens, choice.text = tokens, text
        if output.is_finished():
            choice.finish = "stop" if tokens and tokens[-1] in self.ends else "length"

    def _record(self, flight: _Flight) -> None:
        if self.recorded:
            return
        self.recorded = True
        first = flight.choices[0].last
        stamps = [] if first is None else first.timestamps or []
        ttft = stamps[0] - self.accepted if stamps else None
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
        ok = all(c.error is None for c in flight.choices)
        self.state.metrics.observe(flight.held.name, ok, ttft, tpot)

    def _usage(self, flight: _Flight) -> dict[str, Any]:
        prompts: dict[int, tuple[int, int]] = {}
        for c in flight.choices:
            cached = self.state.engine.cached_tokens(c.request_id)
            prompts[c.prompt] = (c.prompt_len, max(cached, prompts.get(c.prompt, (0, 0))[1]))
        prompt_tokens = sum(n for n, _ in prompts.values())
        completion = sum(len(c.tokens) for c in flight.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())},
        }

    def _logprobs(self, choice: _Choice, start: int, stop: int, text_offset: int) -> Any:
        """The OpenAI ``logprobs`` of ``choice``'s tokens ``start`` to ``stop`` (None if not asked)."""
        if self.params.sampling.logprobs is None:
            return None
        entries = choice.logprobs[start:stop]
        word = self.state.tokenizer.decode
        if self.chat:
            return {
                "content": [
                    {
                        "token": (t := word([e.token])),
                        "logprob": e.logprob,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {"token": (w := word([i])), "logprob": lp, "bytes": list(w.encode())}
                            for i, lp in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        tokens = [word([e.token]) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{word([i]): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _raise_error(self, flight: _Flight) -> None:
        for c in flight.choices:
            if c.error is not None:
                raise HTTPError(500, f"the request failed: {c.error}", "InternalServerError")

    async def whole(self, flight: _Flight) -> Any:
        async for _ in flight.outputs():
            pass
        self._record(flight)
        self._raise_error(flight)
        choices = []
        for c in flight.choices:
            choice: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.finish,
                "logprobs": self._logprobs(c, 0, len(c.tokens), 0),
            }
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            if self.params.return_token_ids:
                choice["token_ids"] = c.tokens
            choices.append(choice)
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(flight),
        }

    def _chunk(self, choice: _Choice, text: str, tokens_end: int, logprobs: Any) -> str:
        body: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish, "logprobs": logprobs}
        if self.chat:
            delta: dict[str, Any] = {} if choice.started else {"role": "assistant"}
            if text:
                delta["content"] = text
            body["delta"] = delta
        else:
            body["text"] = text
        if self.params.return_token_ids:
            body["token_ids"] = choice.tokens[choice.sent_tokens : tokens_end]
        chunk = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [body],
        }
        return f"data: {json.dumps(chunk)}\n\n"

    async def stream(self, flight: _Flight) -> AsyncIterator[str]:
        async for choice in flight.outputs():
            if choice.error is not None:
                break
            # Held back: text that may begin a stop string, and a character still being decoded.
            ready = len(choice.text) if choice.finish is not None else len(choice.text) - self.holdback
            text = choice.text[choice.sent_text : max(ready, choice.sent_text)]
            if text.endswith("\ufffd") and choice.finish is None:
                text = text.rstrip("\ufffd")
            tokens_end = len(choice.tokens)
            if tokens_end > choice.sent_tokens or choice.finish is not None:
                logprobs = self._logprobs(choice, choice.sent_tokens, tokens_end, choice.sent_text)
                yield self._chunk(choice, text, tokens_end, logprobs)
                choice.started = True
                choice.sent_tokens, choice.sent_text = tokens_end, choice.sent_text + len(text)
        self._record(flight)
        failed = next((c for c in flight.choices if c.error is not None), None)
        if failed is not None:
            error = {
                "message": f"the request failed: {failed.error}",
                "type": "InternalServerError",
                "code": 500,
            }
            yield f"data: {json.dumps({'error': error})}\n\n"
        elif self.params.include_usage:
            usage: dict[str, Any] = {
                "id": self.request_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self._usage(flight),
            }
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"


def _adapter_routes(app: FastAPI, state: ServerState, body_of: Any) -> None:
    """vLLM's and SGLang's load/unload endpoints, and pin/unpin."""
    admin = state.admin

    def names(body: dict[str, Any], *fields: str) -> list[str]:
        values = [body.get(f) for f in fields]
        if not all(isinstance(v, str) and v for v in values):
            wanted = " and ".join(f"'{f}'" for f in fields)
            raise HTTPError(400, f"{'Both ' if len(fields) > 1 else ''}{wanted} must be provided.")
        return [str(v) for v in values]

    @app.post("/v1/load_lora_adapter")
    async def vllm_load(request: Request) -> Any:
        body = await body_of(request)
        name, path = names(body, "lora_name", "lora_path")
        inplace = body.get("load_inplace")
        if inplace is not None and not isinstance(inplace, bool):
            raise HTTPError(
                400, f"load_inplace must be true or false (got {inplace!r})", param="load_inplace"
            )
        inplace = bool(inplace) and admin.serves(name)
        if admin.serves(name) and not inplace:
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        try:
            # In place: once the adapter's requests have ended (new ones wait), its weights are
            # replaced (id and pin stay); a refused replacement leaves the old weights serving.
            await admin.load(name, path, replace=inplace)
        except DuplicateAdapterError as e:
            raise HTTPError(
                400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
            ) from e
        except AdapterBusyError as e:
            raise HTTPError(409, str(e), "ConflictError") from e
        except LoraPinError as e:
            raise HTTPError(400, f"Failed to load LoRA adapter '{name}': {e}", "BadRequestError") from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def vllm_unload(request: Request) -> Any:
        (name,) = names(await body_of(request), "lora_name")
        await _unload_or_raise(admin, name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def sglang(action: Any) -> Any:
        try:
            await action()
        except (LoraPinError, HTTPError) as e:
            message = e.message if isinstance(e, HTTPError) else str(e)
            body = {"success": False, "error_message": message, "loaded_adapters": admin.served()}
            return JSONResponse(body, status_code=400)
        return {"success": True, "error_message": None, "loaded_adapters": admin.served()}

    @app.post("/load_lora_adapter")
    async def sglang_load(request: Request) -> Any:
        body = await body_of(request)
        name, path = names(body, "lora_name", "lora_path")
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise HTTPError(400, f"pinned must be true or false (got {pinned!r})", param="pinned")
        return await sglang(lambda: admin.load(name, path, pinned=pinned))

    @app.post("/unload_lora_adapter")
    async def sglang_unload(request: Request) -> Any:
        (name,) = names(await body_of(request), "lora_name")
        return await sglang(lambda: admin.unload(name))

    @app.post("/v1/pin_lora_adapter")
    async def pin(request: Request) -> Any:
        (name,) = names(await body_of(request), "lora_name")
        _pin_or_raise(admin.pin, name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' pinned.")

    @app.post("/v1/unpin_lora_adapter")
    async def unpin(request: Request) -> Any:
        (name,) = names(await body_of(request), "lora_name")
        _pin_or_raise(admin.unpin, name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' unpinned.")


async def _unload_or_raise(admin: AdapterAdmin, name: str) -> None:
    try:
        await admin.unload(name)
    except AdapterNotFoundError as e:
        raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError") from e
    except AdapterBusyError as e:
        raise HTTPError(409, str(e), "ConflictError") from e


def _pin_or_raise(action: Any, name: str) -> None:
    try:
        action(name)
    except AdapterNotFoundError as e:
        raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError") from e
    except LoraPinError as e:
        raise HTTPError(400, str(e), "BadRequestError") from e
