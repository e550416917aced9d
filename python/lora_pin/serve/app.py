"""The HTTP face of ``lora-pin serve``: OpenAI-compatible endpoints and the peers' adapter endpoints.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's, streaming or not; ``model`` names
  the base, an adapter (vLLM) or ``base:adapter`` (SGLang); SGLang's ``lora_path`` field too; vLLM's
  ``return_token_ids`` and ``ignore_eos``;
- ``GET /v1/models``: the base and every adapter, with vLLM's ``root`` and ``parent``;
- ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``: vLLM's bodies, status codes, messages;
- ``POST /load_lora_adapter``, ``/unload_lora_adapter``: SGLang's, ``{success, error_message,
  loaded_adapters}``;
- ``POST /v1/pin_lora_adapter``, ``/v1/unpin_lora_adapter``: ``{lora_name}``, in vLLM's shapes;
- ``GET /health`` (200 while the engine's thread runs, 503 if not), ``GET /metrics`` (Prometheus text).

A request whose client goes away before its answer (a closed stream, a timeout, a dropped connection) is
cancelled in the engine (:meth:`~lora_pin.serve.engine.LoRAEngine.cancel`): its KV-cache pages and its
adapter's count are released and nothing of it stays behind. At most ``max_queued_requests`` requests wait
for the engine to start them; past that a new one is refused at once with 503 and ``Retry-After``
(SGLang's ``--max-queued-requests``, its status and message), so a flood cannot grow the server's memory.

The adapter endpoints exist only with ``allow_runtime_updates`` (as vLLM's exist only when runtime
updating is allowed): without it they are 404. With ``api_key`` every endpoint needs
``Authorization: Bearer <key>`` (401 ``{"error": "Unauthorized"}`` otherwise, vLLM's answer). Errors are
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``. Bodies past ``max_body_bytes`` are 413,
malformed JSON 400; the server goes on.

Decoding is greedy: a request asking for sampling (``temperature`` above 0) or several choices (``n``
above 1) is refused (400) rather than answered differently from what it asked.
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

from lora_pin.errors import AdapterNotFoundError, DuplicateAdapterError, LoraPinError
from lora_pin.serve import DEFAULT_MAX_QUEUED_REQUESTS
from lora_pin.serve.adapters import AdapterAdmin, AdapterBusyError
from lora_pin.serve.naming import UnknownModelError, requested_adapter

if TYPE_CHECKING:
    from lora_pin.serve.engine import LoRAEngine
    from lora_pin.serve.metrics import ServeMetrics

__all__ = ["DEFAULT_MAX_BODY_BYTES", "QUEUE_FULL_RETRY_AFTER_S", "ServerState", "build_app"]

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
        api_key: the key every request must bear (None: none).
        allow_runtime_updates: whether the adapter endpoints exist.
        max_body_bytes: the largest request body.
        default_max_tokens: a chat request's output limit when it sets none.
        max_queued_requests: the most requests waiting for the engine to start them; past it, 503.
    """

    engine: LoRAEngine
    tokenizer: Any
    admin: AdapterAdmin
    metrics: ServeMetrics
    base_name: str
    max_model_len: int
    api_key: str | None = None
    allow_runtime_updates: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = 256
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS


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


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state`` (run it with uvicorn)."""
    app = FastAPI(title="lora-pin serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if state.api_key is not None and request.headers.get("authorization") != f"Bearer {state.api_key}":
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

    @app.get("/metrics")
    async def metrics() -> Any:
        state.admin.log_evictions()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Any:
        created = int(time.time())
        data = [_model_card(state.base_name, state.base_name, None, created)]
        data += [_model_card(n, path, state.base_name, created) for n, path in state.admin.served().items()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        prompt_ids = _prompt_ids(state, body.get("prompt"))
        return await _answer(request, body, prompt_ids, body.get("max_tokens", 16), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await body_of(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPError(400, "messages must be a non-empty list", param="messages")
        try:
            prompt_ids = state.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as e:  # the template's own errors: a message without role or content, say
            raise HTTPError(400, f"messages do not fit the chat template: {e}", param="messages") from e
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "keys"):
            prompt_ids = prompt_ids["input_ids"]
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        return await _answer(request, body, list(prompt_ids), limit or state.default_max_tokens, chat=True)

    async def _answer(
        request: Request, body: dict[str, Any], prompt_ids: list[int], limit: Any, chat: bool
    ) -> Any:
        adapter = _adapter_of(state, body)
        max_tokens = _max_tokens(state, limit, len(prompt_ids))
        if body.get("n", 1) != 1:
            raise HTTPError(400, "n must be 1: this server returns one choice per request", param="n")
        temperature = body.get("temperature")
        if temperature is not None and (not isinstance(temperature, (int, float)) or temperature > 0):
            raise HTTPError(
                400, "this server decodes greedily: temperature must be 0 or unset", param="temperature"
            )
        if state.engine.stats().queued >= state.max_queued_requests:
            state.metrics.count(adapter, "refused")
            raise HTTPError(
                503,
                "The request queue is full.",
                "ServiceUnavailable",
                headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
            )
        if not state.admin.acquire(adapter):
            raise HTTPError(404, UnknownModelError(str(body.get("model"))).args[0], "NotFoundError", "model")
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        answer = _Answer(state, request_id, adapter, body, len(prompt_ids), chat)
        flight = _submit(state, request_id, prompt_ids, adapter, max_tokens, body)
        if body.get("stream"):
            return _Stream(answer.stream(flight.outputs()), flight)
        try:
            return await _unless_disconnected(answer.whole(flight.outputs()), request)
        finally:
            flight.close()

    if state.allow_runtime_updates:
        _adapter_routes(app, state, body_of)
    return app


def _model_card(name: str, root: str, parent: str | None, created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "lora_pin",
        "root": root,
        "parent": parent,
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


def _prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    """A completion's prompt as token ids: a string, a list of ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(state.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    vocab = len(state.tokenizer)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
    ):
        return list(prompt)
    raise HTTPError(
        400,
        f"prompt must be a non-empty string or list of token ids below {vocab} (one prompt)",
        param="prompt",
    )


def _max_tokens(state: ServerState, limit: Any, prompt_len: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise HTTPError(400, f"max_tokens must be a positive integer (got {limit!r})", param="max_tokens")
    if prompt_len + limit > state.max_model_len:
        raise HTTPError(
            400,
            f"the prompt's {prompt_len} tokens plus max_tokens {limit} exceed the model's length "
            f"{state.max_model_len}",
            param="max_tokens",
        )
    return limit


def _submit(
    state: ServerState,
    request_id: str,
    prompt_ids: list[int],
    adapter: str | None,
    max_tokens: int,
    body: dict[str, Any],
) -> _Flight:
    """Queue one request (its count taken by the caller).

    Raises:
        HTTPError: 503, the engine takes no requests now (it is starting again after an error).
    """
    flight = _Flight(state, request_id, adapter)
    engine = state.engine
    try:
        engine.cb.register_result_handler(request_id, flight.queue.put_nowait)
        engine.submit(
            request_id,
            prompt_ids,
            adapter,
            max_new_tokens=max_tokens,
            streaming=bool(body.get("stream")),
            ignore_eos=bool(body.get("ignore_eos")),
        )
    except RuntimeError as e:
        engine.cb.output_router.result_handlers.pop(request_id, None)
        state.admin.release(adapter)
        raise HTTPError(503, str(e), "ServiceUnavailable") from e
    return flight


class _Flight:
    """One request in the engine, from its submission until the server lets it go (:meth:`close`)."""

    def __init__(self, state: ServerState, request_id: str, adapter: str | None) -> None:
        self.state, self.request_id, self.adapter = state, request_id, adapter
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self._closed = False

    async def outputs(self) -> AsyncIterator[Any]:
        """The engine's outputs, each one cumulative, until the finished one."""
        try:
            while not self.finished:
                output = await self.queue.get()
                self.finished = output.is_finished()
                yield output
        finally:
            self.close()

    def close(self) -> None:
        """Let the request go (again: nothing): cancelled in the engine unless its last output came;
        its adapter's count released."""
        if self._closed:
            return
        self._closed = True
        if self.finished:
            self.state.engine.done(self.request_id)
        else:
            self.state.engine.cancel(self.request_id)
            self.state.metrics.count(self.adapter, "cancelled")
        self.state.admin.release(self.adapter)


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
        self,
        state: ServerState,
        request_id: str,
        adapter: str | None,
        body: dict[str, Any],
        prompt_len: int,
        chat: bool,
    ) -> None:
        self.state, self.request_id, self.adapter, self.chat = state, request_id, adapter, chat
        self.model = body.get("model") or state.base_name
        self.prompt_len = prompt_len
        self.return_token_ids = bool(body.get("return_token_ids"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.created = int(time.time())
        self.accepted = time.perf_counter()
        eos = state.engine.cb.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def _record(self, output: Any) -> None:
        stamps = output.timestamps or []
        ttft = stamps[0] - self.accepted if stamps else None
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
        self.state.metrics.observe(self.adapter, output.error is None, ttft, tpot)

    def _finish_reason(self, tokens: list[int]) -> str:
        return "stop" if tokens and tokens[-1] in self.eos else "length"

    def _text(self, tokens: list[int]) -> str:
        return str(self.state.tokenizer.decode(tokens, skip_special_tokens=True))

    def _usage(self, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": completion,
            "total_tokens": self.prompt_len + completion,
        }

    async def whole(self, outputs: AsyncIterator[Any]) -> Any:
        last = None
        async for output in outputs:
            last = output
        assert last is not None
        self._record(last)
        if last.error is not None:
            raise HTTPError(500, f"the request failed: {last.error}", "InternalServerError")
        tokens = list(last.generated_tokens)
        text = self._text(tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self._finish_reason(tokens), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.return_token_ids:
            choice["token_ids"] = tokens
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(len(tokens)),
        }

    def _chunk(self, text: str | None, tokens: list[int], finish: str | None, first: bool) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if self.return_token_ids:
            choice["token_ids"] = tokens
        chunk = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return f"data: {json.dumps(chunk)}\n\n"

    async def stream(self, outputs: AsyncIterator[Any]) -> AsyncIterator[str]:
        sent_tokens: list[int] = []
        sent_text = ""
        first = True
        last = None
        async for output in outputs:
            last = output
            if output.error is not None:
                break
            tokens = list(output.generated_tokens)
            text = self._text(tokens)
            new_text = text[len(sent_text) :] if text.startswith(sent_text) else text
            new_tokens = tokens[len(sent_tokens) :]
            finish = self._finish_reason(tokens) if output.is_finished() else None
            if new_tokens or finish is not None:
                yield self._chunk(new_text, new_tokens, finish, first)
                first = False
            sent_tokens, sent_text = tokens, text
        if last is not None:
            self._record(last)
        if last is not None and last.error is not None:
            error = {
                "message": f"the request failed: {last.error}",
                "type": "InternalServerError",
                "code": 500,
            }
            yield f"data: {json.dumps({'error': error})}\n\n"
        elif self.include_usage:
            usage: dict[str, Any] = {
                "id": self.request_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self._usage(len(sent_tokens)),
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
        inplace = bool(body.get("load_inplace")) and admin.serves(name)
        if admin.serves(name) and not inplace:
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        try:
            # In place: the registered adapter's weights are replaced atomically (id, pin and queued
            # requests stay); a refused replacement leaves the old weights serving.
            await admin.load(name, path, replace=inplace)
        except DuplicateAdapterError as e:
            raise HTTPError(
                400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
            ) from e
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
