"""One lora_pin replica on Ray Serve: the same engine and HTTP app as ``lora-pin serve``, in process.

The replica builds the :class:`~lora_pin.serve.app.ServerState` a ``lora-pin serve`` process builds
(model, manager with its start-up adapters, engine) and the same FastAPI app
(:func:`lora_pin.serve.app.build_app`); the ingress forwards each HTTP request to it whole and relays
the answer as the app sends it (:meth:`LoRAReplica.forward`), so every endpoint, error and stream is
the single server's own.

Before it takes requests, a replica asks the ingress for the adapters the deployment should serve and
reaches exactly them: it starts with its ``--lora-paths`` adapters pinned as the desired adapters say,
then follows :func:`~lora_pin.serve.ray.desired.plan` (:func:`converge`). A replica that died and was
started again so comes back with the adapters, versions and pins set over HTTP since start-up. Its
routing stats (:meth:`LoRAReplica.record_routing_stats`) report what it serves and at which version;
the router sends an adapter's requests only where it is served at the desired version.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ray import serve

from lora_pin.errors import LoraPinError
from lora_pin.serve.app import build_app
from lora_pin.serve.ray.desired import LOADS, Step, plan, startup_adapters, startup_items
from lora_pin.serve.ray.router import RouteHint, replica_stats

if TYPE_CHECKING:
    from lora_pin.serve.app import ServerState

__all__ = ["LoRAReplica", "converge"]

log = logging.getLogger("lora_pin.serve")


async def converge(
    state: ServerState, versions: dict[str, int], desired: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """Bring ``state``'s adapters to ``desired`` (name -> ``{"path", "pinned", "version"}``) by the
    steps of :func:`~lora_pin.serve.ray.desired.plan`; ``versions`` (name -> the version each served
    adapter was loaded at) is updated as loads and replacements succeed. Returns one line per step that
    failed (empty: all applied); the other steps are applied regardless, and each failure is logged.
    """
    admin = state.admin
    served = _served(admin, versions, _placement(admin))
    failures: list[str] = []
    for step in plan(served, desired):
        try:
            await _apply(admin, step)
        except LoraPinError as e:
            log.error("replica converging: %s %r failed: %s", step.action, step.name, e)
            failures.append(f"{step.action} {step.name!r}: {e}")
            continue
        if step.action in ("load", "replace"):
            versions[step.name] = step.version
        elif step.action == "unload":
            versions.pop(step.name, None)
    return failures


def _placement(admin: Any) -> Any:
    """The manager's placement snapshot; None for a server without adapters."""
    return None if admin.manager is None else admin.manager.placement()


def _served(admin: Any, versions: Mapping[str, int], placement: Any) -> dict[str, dict[str, Any]]:
    """Every adapter that takes requests, ``{name: {"path", "pinned", "version"}}`` (-1: a version
    this replica does not know), pins read from ``placement``."""
    pinned = set() if placement is None else {a.name for a in placement.adapters if a.pinned}
    return {
        name: {"path": path, "pinned": name in pinned, "version": versions.get(name, -1)}
        for name, path in admin.served().items()
    }


async def _apply(admin: Any, step: Step) -> None:
    if step.action == "unload":
        await admin.unload(step.name)
    elif step.action == "unpin":
        admin.unpin(step.name)
    elif step.action == "replace":
        await admin.load(step.name, step.path, replace=True)
    elif step.action == "load":
        await admin.load(step.name, step.path)
    else:
        admin.pin(step.name)


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
        self.generation = -1
        desired = await serve.get_deployment_handle(ingress, context.app_name).desired_adapters.remote()
        wanted = desired["adapters"]
        items = startup_items(args, wanted)
        if items is not None:
            # The start-up adapters as the desired adapters pin them: a pin made at run time then finds
            # the room an unpin made for it.
            args = copy.copy(args)
            args.lora_paths = items
        self.state = build_state(args)
        self.app = build_app(self.state)
        # name -> the desired version whose weights this replica serves. A start-up adapter read from the
        # desired path now holds the same weights as a load of that version would.
        self.versions: dict[str, int] = {}
        for name, started in startup_adapters(args).items():
            want = wanted.get(name)
            same = want is not None and os.path.realpath(want["path"]) == os.path.realpath(started["path"])
            self.versions[name] = int(want["version"]) if same else 0
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
    ) -> dict[str, Any]:
        """Answers one ``request`` (as :meth:`forward`) whole, for the ingress: an adapter change made
        as the desired adapters' change ``generation`` (a read: -1). Returns ``{"status", "headers",
        "body", "report"}``, the report (:meth:`report`) taken after the change."""
        status, headers, body = 0, [], bytearray()
        async for message in self.forward(request):
            if "status" in message:
                status, headers = message["status"], message["headers"]
            else:
                body += message["body"]
        if status == 200 and generation >= 0:
            if request["path"] in LOADS:
                # A load or an in-place replacement: these weights are that change's.
                self.versions[str(json.loads(request["body"])["lora_name"])] = generation
            self.generation = max(self.generation, generation)
        return {"status": status, "headers": headers, "body": bytes(body), "report": self.report()}

    async def sync_adapters(self, desired: dict[str, Any], route: RouteHint | None = None) -> dict[str, Any]:
        """Converge to the ingress's ``desired`` adapters (``{"generation", "adapters"}``, see
        :func:`converge`). Returns ``{"failures": [str], "report": ...}``: the steps that failed, one
        line each (also logged), and :meth:`report` after."""
        failures = await converge(self.state, self.versions, desired["adapters"])
        if failures:
            log.error("replica %s serves without: %s", self.name, "; ".join(failures))
        self.generation = max(self.generation, int(desired["generation"]))
        return {"failures": failures, "report": self.report()}

    def desired_state(self, route: RouteHint | None = None) -> dict[str, Any]:
        """What this replica serves, in the ingress's desired-adapters shape: ``{"generation": int,
        "adapters": {name: {"path", "pinned", "version"}}}`` (a restarted ingress adopts the newest
        replica's)."""
        admin = self.state.admin
        return {"generation": self.generation, "adapters": _served(admin, self.versions, _placement(admin))}

    def adapters(self, route: RouteHint | None = None) -> dict[str, Any]:
        """This replica's name and adapters, ``{"replica": str, "adapters": {name: {"tier", "pinned",
        "digest", "generation", "version"}}}`` (from the manager's placement snapshot; ``generation`` is
        the manager's, ``version`` the desired adapters')."""
        manager = self.state.admin.manager
        entries = () if manager is None else manager.placement().adapters
        return {
            "replica": self.name,
            "adapters": {
                a.name: {
                    "tier": a.tier,
                    "pinned": a.pinned,
                    "digest": a.digest,
                    "generation": a.generation,
                    "version": self.versions.get(a.name, -1),
                }
                for a in entries
            },
        }

    def report(self, route: RouteHint | None = None) -> dict[str, Any]:
        """What the router and the ingress know this replica by: its placement snapshot
        (:func:`lora_pin.serve.ray.router.replica_stats`) and ``{"at": int, "generation": int, "serves":
        {name: {"version": int, "pinned": bool}}}``: when it was taken (this process's monotonic clock,
        ns: the newer of two reports is the later), the last desired generation applied, and every
        adapter that takes requests here (one being unloaded does not)."""
        at = time.monotonic_ns()  # before the reads: the state reported is at least as new
        admin = self.state.admin
        placement = _placement(admin)
        serves = {
            name: {"version": entry["version"], "pinned": entry["pinned"]}
            for name, entry in _served(admin, self.versions, placement).items()
        }
        stats = replica_stats(self.name, placement, sum(admin.outstanding().values()))
        return {**stats, "at": at, "generation": self.generation, "serves": serves}

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's hook: :meth:`report`, for the router."""
        return self.report()

    def check_health(self) -> None:
        """Ray Serve's hook: fails while the engine's generation thread is down (it is restarted by the
        engine's supervisor; Ray Serve restarts the replica if it stays down)."""
        if not self.state.engine.is_alive():
            raise RuntimeError(f"replica {self.name}: the engine's generation thread is not running")

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.engine.stop()
