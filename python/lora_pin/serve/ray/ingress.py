"""The ingress of the replicated server: one OpenAI-compatible HTTP face over N lora_pin replicas.

Every request is forwarded whole to a replica, which answers it with the single server's own app, so
endpoints, errors and streams are those of ``lora-pin serve``:

- completions name an adapter; they go to the replica :class:`~lora_pin.serve.ray.router.LoRARouter`
  ranks first for it (placement affinity; pinned adapters and the base by load alone), among the
  replicas that report serving it at its desired version. When no running replica does (all of them
  are converging), the answer is 503 with ``Retry-After``;
- a request whose replica dies before anything of the answer reached the client is sent to another
  replica (at most ``_RELAY_ATTEMPTS`` in all), and so is one a replica answers 404 for an adapter the
  deployment serves (the replica is behind). A stream that already started ends with an error event
  (``data: {"error": ...}``) and a clean close;
- the adapter endpoints (load, unload, pin, unpin in vLLM's and SGLang's shapes) go to every replica,
  one after the other. When all replicas give the same answer it is the answer; when they differ the
  answer is 502 naming each replica with its status and body. What succeeded is recorded as the
  deployment's desired adapters (:mod:`~lora_pin.serve.ray.desired`), which every replica reaches when
  it starts (a restarted replica comes back with them), and again whenever its report differs from
  them (checked every ``_RECONCILE_INTERVAL_S``);
- ``GET /v1/models``, ``/health`` and ``/metrics`` are asked of every replica at once, each given
  ``_READ_TIMEOUT_S``, and merged (:mod:`~lora_pin.serve.ray.merge`: the union of the models with any
  disagreement named, healthy while one replica is, every replica's series labelled by replica); a
  replica that does not answer in time counts as 504, one that is gone as 503;
- everything else goes to the least loaded replica.

The desired adapters live in the ingress: run one ingress replica (the default) per application. An
ingress that Ray Serve starts again while replicas run adopts the desired adapters of the replica with the
newest generation before it answers anything (:meth:`LoRAIngress.desired_adapters` included), so a
replica started after it still gets the adapters loaded over HTTP.
"""

import asyncio
import contextvars
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError

from lora_pin.serve.naming import UnknownModelError, requested_adapter
from lora_pin.serve.ray.desired import (
    ADAPTER_PATHS,
    apply_change,
    differences,
    serves_at,
    startup_adapters,
)
from lora_pin.serve.ray.merge import merge_health, merge_metrics, merge_models
from lora_pin.serve.ray.router import LoRARouter, RouteHint

__all__ = ["REPLICA_DEPLOYMENT", "LoRAIngress", "combine"]

REPLICA_DEPLOYMENT = "LoRAReplica"

# The reads about the whole deployment: asked of every replica, answers merged.
_MERGED_GETS = {"/v1/models": merge_models, "/health": merge_health, "/metrics": merge_metrics}

# How long one replica may take over a load, an unload or a convergence (an unload waits for the
# adapter's requests).
_BROADCAST_TIMEOUT_S = 300.0
# How long one replica may take over a read (/health, /v1/models, /metrics, its report): a replica that
# is dead or stuck must not hold up the answer about the others.
_READ_TIMEOUT_S = 10.0
# How often a call to one replica checks that the replica is still running (Ray Serve would otherwise
# wait for a replica that is gone until the call's own limit).
_GONE_CHECK_S = 0.5
# How often the ingress checks that every replica serves the desired adapters, and how soon it sends
# them again to a replica that did not reach them (a load that failed there, say).
_RECONCILE_INTERVAL_S = 1.0
_RESYNC_RETRY_S = 30.0
# How many replicas one request is tried on (a replica that died under it, or answered 404 for an
# adapter it has not caught up with, hands it to the next).
_RELAY_ATTEMPTS = 3
# What a client told to come back (503) should wait, in seconds.
_RETRY_AFTER_S = 1

log = logging.getLogger("lora_pin.serve")

api = FastAPI(title="lora-pin serve (replicas)", docs_url=None, redoc_url=None, openapi_url=None)

T = TypeVar("T")


class ReplicaGone(Exception):
    """The replica a call was for left the deployment (died, or was replaced) before it answered."""


def _lost(error: BaseException) -> bool:
    """Whether ``error`` says the replica itself went away (its process or node died), rather than
    that the replica raised."""
    gone = (RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError, ReplicaGone)
    return isinstance(error, gone) or isinstance(getattr(error, "cause", None), gone)


def _error(status: int, message: str, kind: str, **extra: Any) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}, **extra}
    return JSONResponse(body, status_code=status)


def _unavailable(message: str) -> JSONResponse:
    response = _error(503, message, "ServiceUnavailable")
    response.headers["Retry-After"] = str(_RETRY_AFTER_S)
    return response


def combine(answers: dict[str, tuple[int, list[tuple[str, str]], bytes]]) -> Response:
    """One answer from every replica's ``(status, headers, body)``: the common answer when all agree,
    else 502 naming each replica's status and body."""
    statuses = {status for status, _, _ in answers.values()}
    if len(statuses) == 1:
        status, headers, body = next(iter(answers.values()))
        media = dict(headers).get("content-type")
        return Response(body, status_code=status, media_type=media)
    per_replica = {
        name: {"status": status, "body": body.decode("utf-8", "replace")}
        for name, (status, _, body) in sorted(answers.items())
    }
    failed = sorted(name for name, (status, _, _) in answers.items() if status != 200)
    ok = sorted(name for name, (status, _, _) in answers.items() if status == 200)
    message = f"the replicas disagree: succeeded on {', '.join(ok) or 'none'}; failed on " + ", ".join(
        f"{n} ({per_replica[n]['status']}: {per_replica[n]['body']})" for n in failed
    )
    return _error(502, message, "ReplicaDisagreement", replicas=per_replica)


def _body_fields(message: dict[str, Any]) -> dict[str, Any] | None:
    """The request's JSON body as a dict; None when it is not one (the replica answers that)."""
    try:
        fields = json.loads(message["body"])
    except (ValueError, UnicodeDecodeError):
        return None
    return fields if isinstance(fields, dict) else None


def _replica_of(headers: list[tuple[str, str]]) -> str | None:
    return dict((k.lower(), v) for k, v in headers).get("x-lora-pin-replica")


def _stream_error(message: str) -> bytes:
    error = {"message": message, "type": "ServiceUnavailable", "param": None, "code": 503}
    return f"data: {json.dumps({'error': error})}\n\n".encode()


async def _whole(answer: Any) -> bytes:
    """The rest of a replica's answer, whole."""
    return b"".join([part["body"] async for part in answer])


async def _first(answer: Any) -> AsyncIterator[dict[str, Any]]:
    """The next message of a replica's answer (none when the answer has ended)."""
    try:
        yield await answer.__anext__()
    except StopAsyncIteration:
        return


async def _rest(first: list[bytes], answer: Any, replica: str | None) -> AsyncIterator[bytes]:
    """A started stream's bytes: ``first``, then the replica's; when the replica dies midway, an error
    event ends the stream (the client sees why) instead of a dropped connection."""
    for chunk in first:
        yield chunk
    try:
        async for part in answer:
            yield part["body"]
    except Exception as e:
        if not _lost(e):
            raise
        log.warning("stream from %s lost with its replica: %s", replica, e)
        yield _stream_error(f"the replica answering this stream ({replica}) went away; ask again")


async def _own_request(
    call: Callable[[], Awaitable[T]],
    replica: str,
    timeout: float,
    router: Callable[[], Awaitable[LoRARouter | None]],
) -> T:
    """Runs ``call()`` as a task in an empty context (a Ray Serve request of its own), waiting at most
    ``timeout`` s and giving up early when ``replica`` leaves the router's running replicas.

    Raises:
        ReplicaGone, TimeoutError: as :meth:`LoRAIngress._call`; anything ``call`` raised.
    """

    async def run() -> T:
        return await call()

    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"replica {replica}: no answer within {timeout:g} s")
            done, _ = await asyncio.wait({task}, timeout=min(_GONE_CHECK_S, left))
            if done:
                return task.result()
            known = await router()
            if known is not None and replica not in known.replica_names():
                raise ReplicaGone(f"replica {replica} left before it answered")
    finally:
        task.cancel()


# ``serve.ingress`` serializes the app, and this class with it, while the class is declared: whatever the
# class uses from this module is defined above it.
@serve.ingress(api)
class LoRAIngress:
    """A Ray Serve deployment class: the HTTP face of the replicas (see the module's docs).

    Args:
        replicas: the handle of the :class:`~lora_pin.serve.ray.replica.LoRAReplica` deployment.
        args: the ``lora-pin serve`` arguments (base model's name, body limit, start-up adapters).
    """

    def __init__(self, replicas: Any, args: Any) -> None:
        self.replicas = replicas
        self.base_name = args.served_model_name or str(args.model)
        self.max_body_bytes = int(args.max_body_bytes)
        self.desired = startup_adapters(args)
        self.generation = 0
        self._changes = asyncio.Lock()
        self._adopted = False
        self._reconciler = asyncio.get_event_loop().create_task(self._reconcile())

    async def desired_adapters(self) -> dict[str, Any]:
        """The adapters every replica should serve (name -> ``{"path", "pinned", "version"}``) and their
        generation: ``{"generation": int, "adapters": {...}}``."""
        await self._adopt()
        return {"generation": self.generation, "adapters": self.desired}

    async def routing(self) -> dict[str, Any]:
        """What this ingress's router goes by now, per running replica: ``{name: {"in_flight": int,
        "report": dict | None}}``, the requests it sent there that have not ended (the queue it spills
        at) and the replica's newest report (``LoRAReplica.report``)."""
        router = await self._router()
        if router is None:
            return {}
        in_flight = dict(router.ranker.in_flight)
        return {
            name: {"in_flight": in_flight.get(name, 0), "report": router.report(name)}
            for name in router.replica_names()
        }

    async def _adopt(self) -> None:
        # Once per ingress: when replicas already run (this ingress was started again), their desired
        # adapters are newer than the start-up ones; take the newest replica's. Replicas still starting
        # are not asked: they are the ones waiting for this answer.
        if self._adopted:
            return
        async with self._changes:
            if self._adopted:
                return
            app_name = serve.get_replica_context().app_name
            deployments = (await asyncio.to_thread(serve.status)).applications[app_name].deployments
            running = deployments[REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0)
            if running:
                router = await self._router()
                for name in [] if router is None else router.replica_names():
                    try:
                        state = await self._call(name, "desired_state", timeout=_BROADCAST_TIMEOUT_S)
                    except Exception as e:  # the replica is going away: another one answers
                        log.warning("replica %s: desired adapters not read: %s", name, e)
                        continue
                    if int(state["generation"]) > self.generation:
                        self.desired, self.generation = dict(state["adapters"]), int(state["generation"])
                log.info(
                    "ingress started beside %d replicas: generation %d adopted", running, self.generation
                )
            self._adopted = True

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, path: str, request: Request) -> Any:
        """Every HTTP request: to one replica or, for the adapter endpoints, to all."""
        await self._adopt()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return _error(413, f"request body over {self.max_body_bytes} bytes", "RequestTooLarge")
        message = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": [(k, v) for k, v in request.headers.items() if k.lower() != "host"],
            "body": bytes(body),
        }
        if request.method == "POST" and request.url.path in ADAPTER_PATHS:
            return await self._broadcast(message)
        if request.method == "GET" and request.url.path in _MERGED_GETS:
            router = await self._router()
            names = [] if router is None else router.replica_names()
            reads = [self._ask(message, n, -1, _READ_TIMEOUT_S) for n in names]
            answers = dict(zip(names, await asyncio.gather(*reads), strict=True))
            return _MERGED_GETS[request.url.path](answers)
        fields = _body_fields(message)
        stream = fields is not None and bool(fields.get("stream"))
        return await self._relay(message, self._hint(message, fields), stream)

    def _hint(self, message: dict[str, Any], fields: dict[str, Any] | None) -> RouteHint:
        if fields is None or message["method"] != "POST" or not message["path"].endswith("completions"):
            return RouteHint()  # whichever replica answers it answers the same error
        try:
            adapter = requested_adapter(
                fields.get("model"), fields.get("lora_path"), self.base_name, self.desired.__contains__
            )
        except (TypeError, UnknownModelError):
            return RouteHint()
        if adapter is None:
            return RouteHint()
        want = self.desired[adapter]
        return RouteHint(adapter=adapter, pinned=bool(want["pinned"]), version=int(want["version"]))

    async def _relay(self, message: dict[str, Any], hint: RouteHint, stream: bool) -> Any:
        """Forwards ``message`` (a ``stream``: its answer relayed as it comes) to the replica the router
        picks, and to another when that one dies before the client got anything, or is behind on
        ``hint.adapter`` (answers 404)."""
        tried: list[str] = []
        lost: list[str] = []
        behind: Response | None = None
        for _ in range(_RELAY_ATTEMPTS):
            attempt = dataclasses.replace(hint, exclude=tuple(tried))
            if hint.version is not None and not await self._served_somewhere(attempt):
                break
            answer = self.replicas.options(method_name="forward", stream=True).remote(message, route=attempt)
            replica: str | None = None
            try:
                head = await answer.__anext__()
                replica = _replica_of(head["headers"])
                headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
                if head["status"] == 404 and hint.adapter is not None:
                    # The replica does not serve an adapter the deployment does: it is behind (its report
                    # was older than its state). Another one answers; its report is asked for afresh.
                    behind = Response(await _whole(answer), status_code=404, headers=headers)
                    tried.append(replica or "")
                    await self._refresh([replica] if replica else [])
                    continue
                if not stream:
                    return Response(await _whole(answer), status_code=head["status"], headers=headers)
                # A stream is the client's from its first chunk on; before that it may still move.
                first = [part["body"] async for part in _first(answer)]
            except asyncio.CancelledError:
                answer.cancel()  # the client left: so does the request on its replica
                raise
            except Exception as e:
                if not _lost(e):
                    raise
                answer.cancel()
                lost.append(f"{replica or 'a replica'} ({type(e).__name__})")
                log.warning("request to %s lost with its replica (%s); trying another", replica, e)
                tried.append(replica or "")
                continue
            return StreamingResponse(
                _rest(first, answer, replica), status_code=head["status"], headers=headers
            )
        if lost:
            return _unavailable("the request was lost with its replica: " + "; ".join(lost))
        if behind is not None:
            return behind
        return _unavailable(
            f"no running replica serves adapter {hint.adapter!r} at its desired version "
            f"{hint.version} yet (replicas are converging)"
        )

    async def _served_somewhere(self, hint: RouteHint) -> bool:
        """Whether a running replica not in ``hint.exclude`` reports serving ``hint.adapter`` at
        ``hint.version`` or newer (replicas with no report yet are asked for one)."""
        router = await self._router()
        if router is None or hint.adapter is None or hint.version is None:
            return router is not None
        names = [n for n in router.replica_names() if n not in hint.exclude]
        await self._refresh([n for n in names if router.report(n) is None])
        reports = [router.report(n) for n in names]
        return any(
            r is not None and serves_at(r.get("serves", {}), hint.adapter, hint.version) for r in reports
        )

    async def _refresh(self, names: list[str]) -> None:
        """Asks each of ``names`` for its report at once (each given ``_READ_TIMEOUT_S``) and notes it
        in the router; a replica that does not answer is left as it was."""

        async def one(name: str) -> None:
            try:
                report = await self._call(name, "report", timeout=_READ_TIMEOUT_S)
            except Exception as e:  # gone or stuck: the router keeps what it knew
                log.info("replica %s: no report: %s", name, e)
                return
            router = await self._router()
            if router is not None:
                router.note(name, report)

        await asyncio.gather(*(one(n) for n in names))

    async def _router(self) -> LoRARouter | None:
        """This process's router over the replicas (None: none answers, so the handle has none yet)."""
        app_name = serve.get_replica_context().app_name
        router = LoRARouter.of(app_name, REPLICA_DEPLOYMENT)
        if router is None:
            # The handle makes its router on its first request.
            health = {"method": "GET", "path": "/health", "query": "", "headers": [], "body": b""}
            first = self.replicas.options(method_name="change").remote(health, -1, route=RouteHint())
            try:
                await asyncio.wait_for(first, _READ_TIMEOUT_S)
            except Exception as e:  # no replica answered; the next request tries again
                log.warning("no replica answered the ingress's first request: %s", e)
            router = LoRARouter.of(app_name, REPLICA_DEPLOYMENT)
        return router

    async def _call(self, replica: str, method: str, *args: Any, timeout: float) -> Any:
        """``method(*args)`` on ``replica``, in a Ray Serve request of its own (so calls to several
        replicas may run at once: calls made in one request share its id, by which Ray Serve matches
        routed replicas to waiting calls, and would be crossed).

        Raises:
            ReplicaGone: the replica left before it answered; TimeoutError: no answer in ``timeout`` s;
                anything the call raised.
        """

        async def call() -> Any:
            return await self.replicas.options(method_name=method).remote(
                *args, route=RouteHint(replica=replica)
            )

        return await _own_request(call, replica, timeout, self._router)

    async def _ask(
        self, message: dict[str, Any], replica: str, generation: int, timeout: float
    ) -> tuple[int, list[Any], bytes]:
        """``message`` answered whole by ``replica`` (``change``), its report noted; a replica that
        is gone answers 503, one that took longer than ``timeout`` 504."""
        try:
            answer = await self._call(replica, "change", message, generation, timeout=timeout)
        except TimeoutError:
            return 504, [("content-type", "text/plain")], f"no answer within {timeout:g} s".encode()
        except Exception as e:  # the replica died or left: its answer says so
            return 503, [("content-type", "text/plain")], f"replica unreachable: {e!r}".encode()
        router = await self._router()
        if router is not None:
            router.note(replica, answer["report"])
        return answer["status"], answer["headers"], answer["body"]

    async def _broadcast(self, message: dict[str, Any]) -> Response:
        async with self._changes:
            router = await self._router()
            names = [] if router is None else router.replica_names()
            if not names:
                return _unavailable("no replica is running")
            generation = self.generation + 1
            # One replica after the other: each change is made where the last one succeeded.
            by_name = {n: await self._ask(message, n, generation, _BROADCAST_TIMEOUT_S) for n in names}
            if any(status == 200 for status, _, _ in by_name.values()):
                body = json.loads(message["body"])
                self.desired = apply_change(self.desired, message["path"], body, generation)
                self.generation = generation
            response = combine(by_name)
            log.info("%s on %d replicas: %d", message["path"], len(names), response.status_code)
            return response

    async def _reconcile(self) -> None:
        # A replica that started while a change was applied, on which a change failed, or whose adapters
        # changed otherwise, reports adapters other than the desired ones: it is sent them, once per
        # generation and again every _RESYNC_RETRY_S while it still differs.
        loop = asyncio.get_running_loop()
        tried: dict[str, tuple[int, float]] = {}
        await self._adopt()
        while True:
            await asyncio.sleep(_RECONCILE_INTERVAL_S)
            try:
                router = await self._router()
                if router is None or self._changes.locked():
                    continue
                names = router.replica_names()
                tried = {n: t for n, t in tried.items() if n in names}
                for name in names:
                    report = router.report(name)
                    if report is None or not differences(report.get("serves", {}), self.desired):
                        continue
                    generation, when = tried.get(name, (-1, float("-inf")))
                    if generation == self.generation and loop.time() - when < _RESYNC_RETRY_S:
                        continue
                    tried[name] = (self.generation, loop.time())
                    await self._sync(name)
            except Exception as e:  # this round failed; the next one looks again
                log.warning("reconciling the replicas' adapters: %s", e)

    async def _sync(self, name: str) -> None:
        """Sends the desired adapters to replica ``name`` (under the change lock: no change is made
        meanwhile) and notes its report after."""
        async with self._changes:
            desired = {"generation": self.generation, "adapters": self.desired}
            router = await self._router()
            try:
                fresh = await self._call(name, "report", timeout=_READ_TIMEOUT_S)
                if router is not None:
                    router.note(name, fresh)
                missing = differences(fresh.get("serves", {}), self.desired)
                if not missing:
                    return
                log.warning("replica %s differs from the desired adapters: %s", name, "; ".join(missing))
                result = await self._call(name, "sync_adapters", desired, timeout=_BROADCAST_TIMEOUT_S)
            except Exception as e:  # the replica is going away; Ray Serve replaces it
                log.warning("replica %s: adapters not synced: %s", name, e)
                return
            if router is not None:
                router.note(name, result["report"])
            if result["failures"]:
                log.error("replica %s: still without: %s", name, "; ".join(result["failures"]))
