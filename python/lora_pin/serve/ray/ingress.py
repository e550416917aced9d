"""The ingress of the replicated server: one OpenAI-compatible HTTP face over N lora_pin replicas.

Every request is forwarded whole to a replica, which answers it with the single server's own app, so
endpoints, errors and streams are those of ``lora-pin serve``:

- completions name an adapter; they go to the replica :class:`~lora_pin.serve.ray.router.LoRARouter`
  ranks first for it (placement affinity; pinned adapters and the base by load alone);
- the adapter endpoints (load, unload, pin, unpin in vLLM's and SGLang's shapes) go to every replica,
  one after the other. When all replicas give the same answer it is the answer; when they differ the
  answer is 502 naming each replica with its status and body. What succeeded is recorded as the
  deployment's desired adapters, which every replica converges to when it starts (a restarted replica
  comes back with them) and whenever its routing stats show it missed a change;
- ``GET /v1/models``, ``/health`` and ``/metrics`` are asked of every replica and merged
  (:mod:`~lora_pin.serve.ray.merge`: the union of the models with any disagreement named, healthy while
  one replica is, every replica's series labelled by replica);
- everything else goes to the least loaded replica.

The desired adapters live in the ingress: run one ingress replica (the default) per application. An
ingress that Ray Serve starts again while replicas run adopts the desired adapters of the replica with the
newest generation before it answers anything (:meth:`LoRAIngress.desired_adapters` included), so a
replica started after it still gets the adapters loaded over HTTP.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from lora_pin.args import lora_config_from_args
from lora_pin.serve.naming import UnknownModelError, requested_adapter
from lora_pin.serve.ray.merge import merge_health, merge_metrics, merge_models
from lora_pin.serve.ray.router import LoRARouter, RouteHint

__all__ = ["REPLICA_DEPLOYMENT", "LoRAIngress"]

REPLICA_DEPLOYMENT = "LoRAReplica"

# The adapter endpoints, by path: what a success means for the desired adapters.
_LOADS = {"/v1/load_lora_adapter", "/load_lora_adapter"}
_UNLOADS = {"/v1/unload_lora_adapter", "/unload_lora_adapter"}
_PINS = {"/v1/pin_lora_adapter": True, "/v1/unpin_lora_adapter": False}
_ADAPTER_PATHS = _LOADS | _UNLOADS | set(_PINS)
# The reads about the whole deployment: asked of every replica, answers merged.
_MERGED_GETS = {"/v1/models": merge_models, "/health": merge_health, "/metrics": merge_metrics}

# How long one replica may take over a load or an unload (an unload waits for the adapter's requests).
_BROADCAST_TIMEOUT_S = 300.0
# How often the ingress checks that every replica serves the desired adapters.
_RECONCILE_INTERVAL_S = 1.0

log = logging.getLogger("lora_pin.serve")

api = FastAPI(title="lora-pin serve (replicas)", docs_url=None, redoc_url=None, openapi_url=None)


def _error(status: int, message: str, kind: str, **extra: Any) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}, **extra}
    return JSONResponse(body, status_code=status)


def startup_adapters(args: Any) -> dict[str, dict[str, Any]]:
    """The adapters the ``lora-pin serve`` arguments ``args`` load at start-up: name -> path, pinned."""
    config = lora_config_from_args(args)
    refs = () if config is None else config.refs
    return {r.lora_name: {"path": r.lora_path, "pinned": bool(r.pinned)} for r in refs}


def apply_change(
    desired: dict[str, dict[str, Any]], path: str, body: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """``desired`` after the adapter endpoint ``path`` succeeded with request ``body`` (a new dict)."""
    changed = {name: dict(want) for name, want in desired.items()}
    name = str(body.get("lora_name"))
    if path in _LOADS:
        inplace = path.startswith("/v1/") and bool(body.get("load_inplace")) and name in changed
        pinned = changed[name]["pinned"] if inplace else bool(body.get("pinned", False))
        changed[name] = {"path": str(body.get("lora_path")), "pinned": pinned}
    elif path in _UNLOADS:
        changed.pop(name, None)
    elif path in _PINS and name in changed:
        changed[name]["pinned"] = _PINS[path]
    return changed


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
        """The adapters every replica should serve (name -> ``{"path", "pinned"}``) and their
        generation: ``{"generation": int, "adapters": {...}}``."""
        await self._adopt()
        return {"generation": self.generation, "adapters": self.desired}

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
                for name in (await self._router()).replica_names():
                    call = self.replicas.options(method_name="desired_state").remote(
                        route=RouteHint(replica=name)
                    )
                    try:
                        state = await asyncio.wait_for(call, _BROADCAST_TIMEOUT_S)
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
        if request.method == "POST" and request.url.path in _ADAPTER_PATHS:
            return await self._broadcast(message)
        if request.method == "GET" and request.url.path in _MERGED_GETS:
            names = (await self._router()).replica_names()
            # One replica after the other, as in _broadcast (calls from one request share its id).
            answers = {n: await self._change(message, n, -1) for n in names}
            return _MERGED_GETS[request.url.path](answers)
        return await self._relay(message, self._hint(message))

    def _hint(self, message: dict[str, Any]) -> RouteHint:
        if message["method"] != "POST" or not message["path"].endswith("completions"):
            return RouteHint()
        try:
            fields = json.loads(message["body"])
            adapter = requested_adapter(
                fields.get("model"), fields.get("lora_path"), self.base_name, self.desired.__contains__
            )
        except (ValueError, UnicodeDecodeError, AttributeError, TypeError, UnknownModelError):
            return RouteHint()  # whichever replica answers it answers the same error
        pinned = adapter is not None and bool(self.desired[adapter]["pinned"])
        return RouteHint(adapter=adapter, pinned=pinned)

    async def _relay(self, message: dict[str, Any], hint: RouteHint) -> Any:
        answer = self.replicas.options(method_name="forward", stream=True).remote(message, route=hint)
        head = await answer.__anext__()

        async def rest() -> AsyncIterator[bytes]:
            async for part in answer:
                yield part["body"]

        headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
        return StreamingResponse(rest(), status_code=head["status"], headers=headers)

    async def _router(self) -> LoRARouter:
        app_name = serve.get_replica_context().app_name
        router = LoRARouter.of(app_name, REPLICA_DEPLOYMENT)
        if router is None:
            # The handle makes its router on its first request.
            health = {"method": "GET", "path": "/health", "query": "", "headers": [], "body": b""}
            await self.replicas.options(method_name="change").remote(health, -1, route=RouteHint())
            router = LoRARouter.of(app_name, REPLICA_DEPLOYMENT)
        assert router is not None
        return router

    async def _change(
        self, message: dict[str, Any], replica: str, generation: int
    ) -> tuple[int, list[Any], bytes]:
        call = self.replicas.options(method_name="change").remote(
            message, generation, route=RouteHint(replica=replica)
        )
        try:
            status, headers, body = await asyncio.wait_for(call, _BROADCAST_TIMEOUT_S)
        except Exception as e:  # the replica died or timed out: its answer says so
            return 503, [("content-type", "text/plain")], f"replica unreachable: {e!r}".encode()
        return status, headers, body

    async def _broadcast(self, message: dict[str, Any]) -> Response:
        async with self._changes:
            names = (await self._router()).replica_names()
            if not names:
                return _error(503, "no replica is running", "ServiceUnavailable")
            generation = self.generation + 1
            # One replica after the other: calls made while handling one HTTP request share its Ray Serve
            # request id, and Ray Serve matches routed replicas to waiting calls by that id, so concurrent
            # calls from one request can be crossed and one of them never sent.
            by_name = {n: await self._change(message, n, generation) for n in names}
            if any(status == 200 for status, _, _ in by_name.values()):
                self.desired = apply_change(self.desired, message["path"], json.loads(message["body"]))
                self.generation = generation
            response = combine(by_name)
            log.info("%s on %d replicas: %d", message["path"], len(names), response.status_code)
            return response

    async def _reconcile(self) -> None:
        # A replica that started while a change was applied, or on which a change failed, reports an older
        # generation than the ingress's: it is told the desired adapters once per generation.
        tried: dict[str, int] = {}
        await self._adopt()
        while True:
            await asyncio.sleep(_RECONCILE_INTERVAL_S)
            app_name = serve.get_replica_context().app_name
            router = LoRARouter.of(app_name, REPLICA_DEPLOYMENT)
            if router is None or self._changes.locked():
                continue
            for replica_id, replica in list(router.curr_replicas.items()):
                name = replica_id.unique_id
                seen = (replica.routing_stats or {}).get("generation", self.generation)
                if seen >= self.generation or tried.get(name) == self.generation:
                    continue
                tried[name] = self.generation
                try:
                    await self.replicas.options(method_name="sync_adapters").remote(
                        self.desired_adapters(), route=RouteHint(replica=name)
                    )
                except Exception as e:  # the replica is going away; Ray Serve replaces it
                    log.warning("replica %s: adapters not synced: %s", name, e)
