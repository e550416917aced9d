"""Adapters at run time: loads, unloads, pins and unpins over HTTP, and the requests each adapter has.

Every request for an adapter is counted from the moment it is accepted until its last output
(:meth:`AdapterAdmin.acquire` / :meth:`AdapterAdmin.release`). An unload first stops new requests for the
adapter (they get 404, as for an unknown adapter), then waits for its queued and running requests to end,
and only then unloads it from the manager, so no request is failed by an unload. Each adapter event
(load, unload, pin, unpin, eviction, refusal) is one log line on the ``lora_pin.serve`` logger.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lora_pin.errors import AdapterNotFoundError, LoraPinError
from lora_pin.serve.metrics import BASE_LABEL

if TYPE_CHECKING:
    from lora_pin._core import LoRARef
    from lora_pin.model import LoRAManager

__all__ = ["AdapterAdmin", "AdapterBusyError"]

log = logging.getLogger("lora_pin.serve")

# How long an unload waits for the adapter's queued and running requests before it gives up.
DEFAULT_UNLOAD_TIMEOUT_S = 120.0


class AdapterBusyError(LoraPinError):
    """An unload of an adapter whose requests did not end in time (it stays loaded and serves again)."""


class AdapterAdmin:
    """The server's view of ``manager``'s adapters: which accept requests, and how many each has.

    Thread safety: every method may be called from the event loop while the engine's thread runs steps;
    the manager's own calls that read from disk or wait run on worker threads.
    """

    def __init__(
        self,
        manager: LoRAManager | None,
        startup: Iterable[LoRARef] = (),
        unload_timeout: float = DEFAULT_UNLOAD_TIMEOUT_S,
    ) -> None:
        self.manager = manager
        # name -> path of every adapter registered through this server (the registry lists no names).
        self._paths: dict[str, str] = {r.lora_name: r.lora_path for r in startup}
        self.unload_timeout = unload_timeout
        self._lock = threading.Lock()
        self._outstanding: Counter[str] = Counter()
        self._draining: set[str] = set()
        self._evictions: dict[tuple[str, str], int] = {}

    @property
    def _lora(self) -> LoRAManager:
        if self.manager is None:
            raise AdapterNotFoundError("LoRA is off on this server (no adapter can be loaded)")
        return self.manager

    def _registered(self, name: str) -> bool:
        return self.manager is not None and name in self.manager.registry

    def serves(self, name: str) -> bool:
        """Whether requests for ``name`` are accepted now (registered, not being unloaded)."""
        with self._lock:
            return name not in self._draining and self._registered(name)

    def acquire(self, name: str | None) -> bool:
        """Count one request for ``name`` (None: the base); False if it is not served now."""
        if name is None:
            with self._lock:
                self._outstanding[BASE_LABEL] += 1
            return True
        with self._lock:
            if name in self._draining or not self._registered(name):
                return False
            self._outstanding[name] += 1
            return True

    def release(self, name: str | None) -> None:
        """The request counted by :meth:`acquire` for ``name`` has ended."""
        key = BASE_LABEL if name is None else name
        with self._lock:
            self._outstanding[key] -= 1
            if self._outstanding[key] <= 0:
                del self._outstanding[key]

    def outstanding(self) -> dict[str, int]:
        """Queued and running requests per adapter (``__base__``: the base model; none: left out)."""
        with self._lock:
            return dict(self._outstanding)

    def served(self) -> dict[str, str]:
        """The adapters that accept requests and their paths, by name."""
        with self._lock:
            return {n: p for n, p in sorted(self._paths.items()) if n not in self._draining}

    async def load(self, name: str, path: str, *, pinned: bool = False, replace: bool = False) -> None:
        """Load the adapter at ``path`` as ``name`` (read on a worker thread); with ``replace``, replace a
        registered ``name``'s weights in place (:meth:`LoRAManager.load`).

        Raises:
            DuplicateAdapterError, AdapterLoadError, PathNotAllowedError, CapacityError, SpecError: as
                :meth:`LoRAManager.load`; nothing changes then.
        """
        try:
            ref = await asyncio.to_thread(self._lora.load, name, path, pinned=pinned, replace=replace)
        except LoraPinError as e:
            log.warning("adapter %r: load refused: %s", name, e)
            raise
        with self._lock:
            # A replacement keeps the registration (and so its first path): the new weights' path is ours.
            self._paths[name] = path if replace else ref.lora_path
        what = "replaced in place" if replace else "loaded"
        log.info(
            "adapter %r: %s from %s (id %s%s)", name, what, path, ref.lora_id, ", pinned" if pinned else ""
        )

    async def unload(self, name: str) -> None:
        """Stop new requests for ``name``, wait for its queued and running ones, then unload it.

        Raises:
            AdapterNotFoundError: ``name`` is not registered (or is being unloaded already).
            AdapterBusyError: its requests did not end within the unload timeout; it serves again.
        """
        with self._lock:
            if name in self._draining or not self._registered(name):
                log.warning("adapter %r: unload refused: not loaded", name)
                raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
            self._draining.add(name)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.unload_timeout
            while self._outstanding.get(name, 0) > 0:
                if loop.time() > deadline:
                    log.warning("adapter %r: unload refused: its requests did not end in time", name)
                    raise AdapterBusyError(
                        f"adapter {name!r} still has {self._outstanding.get(name, 0)} requests after "
                        f"{self.unload_timeout:g} s; it stays loaded"
                    )
                await asyncio.sleep(0.01)
            await asyncio.to_thread(self._lora.unload, name, self.unload_timeout)
            with self._lock:
                self._paths.pop(name, None)
        finally:
            with self._lock:
                self._draining.discard(name)
        log.info("adapter %r: unloaded", name)

    def pin(self, name: str) -> None:
        """Pin ``name``. Raises AdapterNotFoundError or CapacityError as :meth:`LoRAManager.pin`."""
        try:
            self._lora.pin(name)
        except LoraPinError as e:
            log.warning("adapter %r: pin refused: %s", name, e)
            raise
        log.info("adapter %r: pinned", name)

    def unpin(self, name: str) -> None:
        """Unpin ``name``. Raises AdapterNotFoundError as :meth:`LoRAManager.unpin`."""
        try:
            self._lora.unpin(name)
        except LoraPinError as e:
            log.warning("adapter %r: unpin refused: %s", name, e)
            raise
        log.info("adapter %r: unpinned", name)

    def log_evictions(self) -> None:
        """One log line per eviction since the last call (the manager counts them per adapter and tier)."""
        current = {} if self.manager is None else dict(self.manager.residency.evictions)
        for (name, tier), count in current.items():
            for _ in range(count - self._evictions.get((name, tier), 0)):
                log.info("adapter %r: evicted from the %s tier", name, tier)
        self._evictions = current
