"""One lora_pin replica on Ray Serve: the same engine and HTTP app as ``lora-pin serve``, in process.

The replica builds the :class:`~lora_pin.serve.app.ServerState` a ``lora-pin serve`` process builds
(model, manager with its start-up adapters, engine) and the same FastAPI app
(:func:`lora_pin.serve.app.build_app`); the ingress forwards each HTTP request to it whole and relays
the answer as the app sends it (:meth:`LoRAReplica.forward`), so every endpoint, error and stream is
the single server's own. Before it takes requests, a replica asks the ingress for the adapters the
deployment should serve and converges to them (:func:`converge`): a replica that died and was started
again comes back with the adapters and pins loaded over HTTP since start-up.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from ray import serve

from lora_pin.errors import LoraPinError
from lora_pin.serve.app import build_app
from lora_pin.serve.ray.router import RouteHint, replica_stats

if TYPE_CHECKING:
    from lora_pin.serve.app import ServerState

__all__ = ["LoRAReplica", "converge"]

log = logging.getLogger("lora_pin.serve")


async def converge(state: ServerState, desired: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Bring ``state``'s adapters to ``desired`` (name -> ``{"path": str, "pinned": bool}``): unload what
    is not desired, load what is missing, pin and unpin to match. Returns one line per change that
    failed (empty: all applied); the rest is applied regardless, and each failure is logged.
    """
    admin = state.admin
    failures: list[str] = []

    async def attempt(what: str, action: Callable[[], Any]) -> None:
        try:
            result = action()
            if asyncio.iscoroutine(result):
                await result
        except LoraPinError as e:
            log.error("replica start: %s failed: %s", what, e)
            failures.append(f"{what}: {e}")

    served = admin.served()
    for name in sorted(set(served) - set(desired)):
        await attempt(f"unload {name!r}", partial(admin.unload, name))
    for name, want in sorted(desired.items()):
        path, pinned = str(want["path"]), bool(want.get("pinned", False))
        if name not in served:
            await attempt(f"load {name!r}", partial(admin.load, name, path, pinned=pinned))
            continue
        if os.path.realpath(served[name]) != os.path.realpath(path):
            await attempt(f"replace {name!r}", partial(admin.load, name, path, replace=True))
        now_pinned = admin.manager is not None and admin.manager.placement()[name].pinned
        if pinned != now_pinned:
            await attempt(
                f"{'pin' if pinned else 'unpin'} {name!r}",
                partial(admin.pin if pinned else admin.unpin, name),
            )
    return failures


async def _asgi_exchange(app: Any, request: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Runs one HTTP ``request`` (method, path, query, headers, body) through the ASGI ``app``; yields
    ``{"status", "headers"}`` first, then ``{"body": bytes}`` as the app sends it."""
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False
    path = str(request["path"])
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": str(request.get("query", "")).encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
        "client": None,
        "server": None,
    }

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": bytes(request["body"]), "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": int(message["status"]), "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield {"body": bytes(message["body"])}
                if not message.get("more_body", False):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        # The client left (or the answer is complete): the app sees a disconnect and cancels its
        # request in the engine.
        disconnected.set()
        await asyncio.wait_for(asyncio.shield(task), timeout=30)


class LoRAReplica:
    """A Ray Serve deployment class: one engine and its :class:`~lora_pin.model.LoRAManager`.

    Args:
        build_state: builds the server state from ``args`` (``lora_pin.cli.serve_cmd.build_server``:
            the model, the manager with its start-up adapters, the engine started).
        args: the ``lora-pin serve`` arguments.
        ingress: the ingress deployment's name (the replica asks it for the adapters to serve).

    Raises:
        SpecError, AdapterLoadError: as ``build_state``; Ray Serve then starts the replica again.
    """

    # Ray Serve awaits an async constructor; type checkers want __init__ to return None.
    async def __init__(  # type: ignore[misc]
        self, build_state: Callable[[Any], ServerState], args: Any, ingress: str
    ) -> None:
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.state = build_state(args)
        self.app = build_app(self.state)
        self.generation = -1
        desired = await serve.get_deployment_handle(ingress, context.app_name).desired_adapters.remote()
        await self.sync_adapters(desired)

    async def forward(
        self, request: dict[str, Any], route: RouteHint | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Answers one HTTP ``request`` (``method``, ``path``, ``query``, ``headers`` as (name, value)
        pairs, ``body`` bytes) with the single server's app: yields ``{"status", "headers"}`` (with
        ``x-lora-pin-replica`` naming this replica), then ``{"body": bytes}`` chunks. ``route`` is the
        router's (:class:`~lora_pin.serve.ray.router.RouteHint`), unused here."""
        async for message in _asgi_exchange(self.app, request):
            if "status" in message:
                message["headers"].append(("x-lora-pin-replica", self.name))
            yield message

    async def change(
        self, request: dict[str, Any], generation: int, route: RouteHint | None = None
    ) -> tuple[int, list[Any], bytes]:
        """Answers one adapter endpoint ``request`` (as :meth:`forward`) whole: ``(status, headers,
        body)``; a success brings this replica to the ingress's desired-adapters ``generation``."""
        status, headers, body = 0, [], bytearray()
        async for message in self.forward(request):
            if "status" in message:
                status, headers = message["status"], message["headers"]
            else:
                body += message["body"]
        if status == 200:
            self.generation = max(self.generation, generation)
        return status, headers, bytes(body)

    async def sync_adapters(self, desired: dict[str, Any], route: RouteHint | None = None) -> list[str]:
        """Converge to the ingress's ``desired`` adapters (``{"generation", "adapters"}``, see
        :func:`converge`); returns the failures, one line each (also logged)."""
        failures = await converge(self.state, desired["adapters"])
        if failures:
            log.error("replica %s serves without: %s", self.name, "; ".join(failures))
        self.generation = max(self.generation, int(desired["generation"]))
        return failures

    def desired_state(self, route: RouteHint | None = None) -> dict[str, Any]:
        """What this replica serves, in the ingress's desired-adapters shape: ``{"generation": int,
        "adapters": {name: {"path", "pinned"}}}`` (a restarted ingress adopts the newest replica's)."""
        admin = self.state.admin
        entries = () if admin.manager is None else admin.manager.placement().adapters
        pinned = {a.name for a in entries if a.pinned}
        adapters = {name: {"path": path, "pinned": name in pinned} for name, path in admin.served().items()}
        return {"generation": self.generation, "adapters": adapters}

    def adapters(self, route: RouteHint | None = None) -> dict[str, Any]:
        """This replica's name and adapters, ``{"replica": str, "adapters": {name: {"tier", "pinned",
        "digest", "generation"}}}`` (from the manager's placement snapshot)."""
        manager = self.state.admin.manager
        entries = () if manager is None else manager.placement().adapters
        return {
            "replica": self.name,
            "adapters": {
                a.name: {"tier": a.tier, "pinned": a.pinned, "digest": a.digest, "generation": a.generation}
                for a in entries
            },
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's hook: this replica's placement snapshot for the router (see
        :func:`lora_pin.serve.ray.router.replica_stats`)."""
        manager = self.state.admin.manager
        placement = None if manager is None else manager.placement()
        stats = replica_stats(self.name, placement, sum(self.state.admin.outstanding().values()))
        return {**stats, "generation": self.generation}

    def check_health(self) -> None:
        """Ray Serve's hook: fails while the engine's generation thread is down (it is restarted by the
        engine's supervisor; Ray Serve restarts the replica if it stays down)."""
        if not self.state.engine.is_alive():
            raise RuntimeError(f"replica {self.name}: the engine's generation thread is not running")

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.engine.stop()
