"""Awaiting an adapter's unload from asyncio code without blocking the event loop.

``LoRARegistry.unload`` blocks its thread (with the GIL released) until the adapter's in-flight
requests finish; inside an event loop use :func:`unload_async`, which polls ``finish_unload`` with a
short, growing sleep so cancellation takes effect at once and no thread is tied up.
"""

from __future__ import annotations

import asyncio
import time

from lora_pin._core import LoRARegistry, _unload_timeout_error

__all__ = ["unload_async"]

_FIRST_POLL_S = 0.001
_LONGEST_POLL_S = 0.05


async def unload_async(registry: LoRARegistry, name: str, timeout: float | None = None) -> None:
    """Unregisters ``name`` at once (no new acquires) and returns once its requests drained and it is
    forgotten. Idempotent, like ``LoRARegistry.unload``.

    Raises:
        AdapterNotFoundError: ``name`` was never registered.
        UnloadTimeoutError: requests are still in flight after ``timeout`` seconds; the adapter stays
            unregistered and a later unload finishes it.
    """
    started = time.monotonic()
    delay = _FIRST_POLL_S
    handle = registry.begin_unload(name)
    # Polled by handle: a later adapter registered under the same name is never unloaded by this.
    while handle is not None and (in_flight := registry.finish_unload(handle)) > 0:
        waited = time.monotonic() - started
        if timeout is not None and waited >= timeout:
            raise _unload_timeout_error(name, in_flight, waited)
        sleep = delay if timeout is None else min(delay, max(timeout - waited, 0.0))
        await asyncio.sleep(sleep)
        delay = min(delay * 2, _LONGEST_POLL_S)
