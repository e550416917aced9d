"""Pinned adapters in vLLM: start-up pins, ``/v1/pin_lora_adapter`` and ``/v1/unpin_lora_adapter``, and
``pinned`` on ``/v1/load_lora_adapter``.

A pin lives in three of vLLM's processes, each told by the one before:

- the API server (:class:`PinEndpoints`, a ``vllm.endpoint_plugins`` entry) resolves the adapter's name
  and asks the engine core (``engine_client.engine_core.call_utility_async``);
- the engine core (:func:`set_pin`, added to vLLM's ``EngineCore``) refuses a pin that would leave no
  slot for other adapters, records it in the scheduler (:class:`lora_pin.vllm.Scheduler` reserves its
  slot from the next step on) and tells the workers;
- each worker (:func:`worker_set_pin`, added to vLLM's ``WorkerBase``) pins the adapter in its LoRA
  manager's caches once it is resident (the wrapped ``activate_adapter`` pins it as it is put in a slot),
  so vLLM's LRU never evicts it.

A pinned adapter takes its slot on its first request and never leaves it until unpinned. Start-up pins
come from ``--lora-modules`` JSON items with ``"pinned": true``: ``lora-pin vllm-serve`` takes the key
out (vLLM's parser refuses unknown keys) and passes the names in ``LORA_PIN_VLLM_PINNED``.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (``Request``, imported
# where the routes are made) as objects.
import json
import os
from http import HTTPStatus
from typing import Any

__all__ = ["PINNED_ENV", "PinEndpoints", "set_pin", "split_pinned_modules", "worker_set_pin"]

#: Comma-separated adapter names pinned at start-up (set by ``lora-pin vllm-serve``).
PINNED_ENV = "LORA_PIN_VLLM_PINNED"


def split_pinned_modules(items: list[str]) -> tuple[list[str], list[str]]:
    """``--lora-modules`` items with ``"pinned"`` taken out of the JSON ones, and the names pinned.

    Raises:
        ValueError: an item's ``"pinned"`` is not a boolean.
    """
    out, pinned = [], []
    for item in items:
        if not item.lstrip().startswith("{"):
            out.append(item)
            continue
        spec = json.loads(item)
        flag = spec.pop("pinned", False)
        if not isinstance(flag, bool):
            raise ValueError(f"--lora-modules item {item!r}: 'pinned' must be true or false")
        if flag:
            pinned.append(str(spec.get("name")))
        out.append(json.dumps(spec))
    return out, pinned


def set_pin(engine_core: Any, lora_id: int, pinned: bool) -> bool:
    """``EngineCore.lora_pin_set_pin``: pins (or unpins) vLLM adapter ``lora_id``; returns whether that
    changed anything.

    Raises:
        ValueError: the scheduler is not lora_pin's, or the pin would leave no slot for other adapters.
    """
    from lora_pin.vllm.scheduler import Scheduler

    scheduler = engine_core.scheduler
    if not isinstance(scheduler, Scheduler):
        raise ValueError("pins need --scheduler-cls lora_pin.vllm.Scheduler (lora-pin vllm-serve passes it)")
    pins = scheduler.pinned_loras
    if pinned == (lora_id in pins):
        return False
    slots = scheduler.lora_config.max_loras
    if pinned and len(pins) + 1 > slots - 1:
        raise ValueError(
            f"pinning would leave no slot for other adapters: {len(pins)} of --max-loras {slots} are "
            "pinned already"
        )
    engine_core.model_executor.collective_rpc("lora_pin_set_pin", args=(lora_id, pinned))
    if pinned:
        pins.add(lora_id)
    else:
        pins.discard(lora_id)
    return True


def worker_set_pin(worker: Any, lora_id: int, pinned: bool) -> None:
    """``WorkerBase.lora_pin_set_pin``: the worker's LoRA manager pins ``lora_id`` in its caches (now if
    resident, else when activated), or unpins it."""
    manager = worker.model_runner.lora_manager._adapter_manager
    pins: set[int] = manager.__dict__.setdefault("lora_pin_pins", set())
    caches = (manager._active_adapters, manager._registered_adapters)
    if pinned:
        pins.add(lora_id)
        for cache in caches:
            if lora_id in cache:
                cache.pin(lora_id)
    else:
        pins.discard(lora_id)
        for cache in caches:
            if lora_id in cache.pinned_items:
                cache._unpin(lora_id)  # vLLM has no public unpin


def pin_on_activation(manager: Any, lora_id: int) -> None:
    """Called as ``lora_id`` is put in a slot: a pinned adapter is pinned in the caches there."""
    if lora_id in manager.__dict__.get("lora_pin_pins", ()):
        manager._active_adapters.pin(lora_id)
        if lora_id in manager._registered_adapters:
            manager._registered_adapters.pin(lora_id)


class PinEndpoints:
    """The ``vllm.endpoint_plugins`` entry: pin routes, and ``pinned`` on the load route."""

    name = "lora_pin"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.engine_client: Any = None

    def attach_router(self, app: Any) -> None:
        from fastapi import Request
        from fastapi.responses import JSONResponse, Response
        from vllm.entrypoints.openai.models.api_router import models
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        def error(status: HTTPStatus, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "code": int(status)}}, status_code=int(status))

        async def body_of(raw: Request) -> dict[str, Any] | JSONResponse:
            try:
                body = await raw.json()
            except ValueError:
                return error(HTTPStatus.BAD_REQUEST, "the body is not JSON")
            if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
                return error(HTTPStatus.BAD_REQUEST, "the body must be an object with a string 'lora_name'")
            pinned = body.get("pinned", False)
            if not isinstance(pinned, bool):
                return error(HTTPStatus.BAD_REQUEST, "'pinned' must be true or false")
            return body

        async def pin_route(raw: Request, pinned: bool) -> Response:
            body = await body_of(raw)
            if isinstance(body, JSONResponse):
                return body
            return await self.pin(models(raw), body["lora_name"], pinned)

        async def pin_lora_adapter(raw: Request) -> Response:
            return await pin_route(raw, True)

        async def unpin_lora_adapter(raw: Request) -> Response:
            return await pin_route(raw, False)

        async def load_lora_adapter(raw: Request) -> Response:
            body = await body_of(raw)
            if isinstance(body, JSONResponse):
                return body
            pinned = body.pop("pinned", False)
            handler = models(raw)
            try:
                request = LoadLoRAAdapterRequest(**body)
            except (TypeError, ValueError) as e:
                return error(HTTPStatus.BAD_REQUEST, str(e))
            response = await handler.load_lora_adapter(request)
            if isinstance(response, ErrorResponse):
                return JSONResponse(content=response.model_dump(), status_code=response.error.code)
            if pinned:
                pin = await self.pin(handler, request.lora_name, True)
                if pin.status_code != HTTPStatus.OK:
                    return pin
            return Response(status_code=200, content=response)

        app.add_api_route("/v1/pin_lora_adapter", pin_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unpin_lora_adapter", unpin_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Keeps the engine client and pins the start-up pins (names in ``LORA_PIN_VLLM_PINNED``).

        Raises:
            ValueError: a start-up pin names no adapter of ``--lora-modules``, or is refused.
        """
        self.engine_client = engine_client
        names = [n for n in os.environ.get(PINNED_ENV, "").split(",") if n]
        for name in names:
            response = await self.pin(state.openai_serving_models, name, True)
            if response.status_code != HTTPStatus.OK:
                raise ValueError(f"start-up pin of {name!r} refused: {response.body.decode()}")

    async def pin(self, handler: Any, name: str, pinned: bool) -> Any:
        """Pins or unpins adapter ``name``: 200, 404 (no such adapter) or 409 (refused, with why)."""
        from fastapi.responses import JSONResponse, Response

        lora_request = handler.lora_requests.get(name)
        if lora_request is None:
            message = f"no adapter named {name!r} is loaded"
            return JSONResponse({"error": {"message": message, "code": 404}}, status_code=404)
        try:
            await self.engine_client.engine_core.call_utility_async(
                "lora_pin_set_pin", lora_request.lora_int_id, pinned
            )
        except Exception as e:
            message = str(e)
            return JSONResponse({"error": {"message": message, "code": 409}}, status_code=409)
        what = "pinned" if pinned else "unpinned"
        return Response(status_code=200, content=f"Success: LoRA adapter '{name}' {what}.")
