"""Adapters at run time: loads, unloads, pins and unpins over HTTP, and the requests each adapter has.

Every request for an adapter is counted from the moment it is accepted until its last output: it holds
a :class:`Lease` (:meth:`AdapterAdmin.acquire`) whose release is idempotent. An unload first stops new
requests for the adapter (they get 404, as for an unknown adapter), then waits for its queued and running
requests to end, and only then unloads it from the manager, so no request is failed by an unload.

A request keeps its version: a replacement of an adapter's weights (``load(..., replace=True)``, vLLM's
``load_inplace``) holds new requests of that adapter back, waits for its queued and running requests to
end, then replaces the weights; the held requests then start on the new weights, as does every request
accepted after the call returns. So every request runs from its first token to its last on one version's
weights (and its prefix-cache key is that version's digest). A replacement whose requests do not end
within the drain timeout is refused (:class:`AdapterBusyError`) and the old weights serve on.

Each adapter event (load, replacement, unload, pin, unpin, refusal) is one log line on the
``lora_pin.serve`` logger, at the time it happens; evictions are logged by the engine after the step
that made them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lora_pin.errors import AdapterNotFoundError, LoraPinError, SpecError
from lora_pin.serve.metrics import BASE_LABEL

if TYPE_CHECKING:
    from lora_pin._core import LoRARef
    from lora_pin.model import LoRAManager

__all__ = ["MAX_ADAPTER_NAME_CHARS", "AdapterAdmin", "AdapterBusyError", "Lease", "check_adapter_name"]

log = logging.getLogger("lora_pin.serve")

# How long an unload (or a replacement) waits for the adapter's queued and running requests.
DEFAULT_UNLOAD_TIMEOUT_S = 120.0
# The longest adapter name the server registers (vLLM and SGLang set none; a request names it whole).
MAX_ADAPTER_NAME_CHARS = 256


class AdapterBusyError(LoraPinError):
    """An unload or replacement of an adapter whose requests did not end in time (nothing changes)."""


def check_adapter_name(name: str, base_name: str | None) -> None:
    """Refuse a name no request could reach, or one past :data:`MAX_ADAPTER_NAME_CHARS`.

    Raises:
        SpecError: ``name`` is empty, too long, has control characters, is the base model's name (a
            request naming it gets the base), or starts with ``<base>:`` (SGLang's ``<base>:<adapter>``
            form: a request naming it is read as the adapter after the colon).
    """
    if not name or len(name) > MAX_ADAPTER_NAME_CHARS or not name.isprintable():
        raise SpecError(
            f"an adapter name must be 1 to {MAX_ADAPTER_NAME_CHARS} printable characters "
            f"(got {len(name)} characters)"
        )
    if base_name is not None and name == base_name:
        raise SpecError(f"{name!r} is the base model's name: requests naming it get the base model")
    if base_name is not None and name.startswith(base_name + ":"):
        raise SpecError(
            f"{name!r} starts with '{base_name}:': a request naming it would be read as the adapter "
            f"{name[len(base_name) + 1 :]!r} (SGLang's '<base>:<adapter>')"
        )


class Lease:
    """One request's hold on its adapter (or on the base model), from acceptance to its last output.

    Attributes:
        name: the adapter (None: the base model).
        digest: the content digest of the weights it runs with (None: the base model): its prefix-cache
            key. Fixed for the lease's life: a replacement waits for every lease of the adapter.
    """

    def __init__(self, admin: AdapterAdmin, name: str | None, digest: str | None) -> None:
        self._admin, self.name, self.digest = admin, name, digest
        self._released = False

    def release(self) -> None:
        """End the hold (again: nothing)."""
        if not self._released:
            self._released = True
            self._admin._release(self.name)


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
        base_name: str | None = None,
    ) -> None:
        self.manager = manager
        self.base_name = base_name
        # name -> path of every adapter registered through this server (the registry lists no names).
        self._paths: dict[str, str] = {r.lora_name: r.lora_path for r in startup}
        self.unload_timeout = unload_timeout
        self._lock = threading.Lock()
        self._outstanding: Counter[str] = Counter()
        self._draining: set[str] = set()
        # Adapters whose weights are being replaced -> set once the replacement is over.
        self._replacing: dict[str, asyncio.Event] = {}

    @property
    def _lora(self) -> LoRAManager:
        if self.manager is None:
            raise AdapterNotFoundError("LoRA is off on this server (no adapter can be loaded)")
        return self.manager

    def _digest(self, name: str) -> str | None:
        """``name``'s content digest; None if it is not registered."""
        if self.manager is None:
            return None
        try:
            return self.manager.identity(name).digest
        except AdapterNotFoundError:
            return None

    def _registered(self, name: str) -> bool:
        return self._digest(name) is not None

    def serves(self, name: str) -> bool:
        """Whether requests for ``name`` are accepted now (registered, not being unloaded)."""
        with self._lock:
            return name not in self._draining and self._registered(name)

    async def acquire(self, name: str | None) -> Lease | None:
        """Count one request for ``name`` (None: the base) and return its lease; None if ``name`` is not
        served now. Waits while ``name``'s weights are being replaced (the request then gets the new
        ones)."""
        if name is None:
            with self._lock:
                self._outstanding[BASE_LABEL] += 1
            return Lease(self, None, None)
        while (replacing := self._replacing.get(name)) is not None:
            await replacing.wait()
        with self._lock:
            digest = self._digest(name)
            if name in self._draining or digest is None:
                return None
            self._outstanding[name] += 1
            return Lease(self, name, digest)

    def _release(self, name: str | None) -> None:
        """The request counted by :meth:`acquire` for ``name`` has ended (through its lease)."""
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

    async def _drained(self, name: str, what: str) -> None:
        """Returns once ``name`` has no queued or running request.

        Raises:
            AdapterBusyError: some are still there after the unload timeout.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.unload_timeout
        while self._outstanding.get(name, 0) > 0:
            if loop.time() > deadline:
                log.warning("adapter %r: %s refused: its requests did not end in time", name, what)
                raise AdapterBusyError(
                    f"adapter {name!r} still has {self._outstanding.get(name, 0)} requests after "
                    f"{self.unload_timeout:g} s; nothing changed"
                )
            await asyncio.sleep(0.01)

    async def load(self, name: str, path: str, *, pinned: bool = False, replace: bool = False) -> None:
        """Load the adapter at ``path`` as ``name`` (read on a worker thread); with ``replace``, replace a
        registered ``name``'s weights in place (:meth:`LoRAManager.load`) once its requests have ended,
        holding its new requests back meanwhile (module docs).

        Raises:
            DuplicateAdapterError, AdapterLoadError, PathNotAllowedError, CapacityError: as
                :meth:`LoRAManager.load`; nothing changes then.
            SpecError: as :meth:`LoRAManager.load`, or a new name no request could reach
                (:func:`check_adapter_name`).
            AdapterBusyError: a replacement whose adapter's requests did not end in time.
        """
        replacing = replace and self._registered(name)
        try:
            if not replacing:
                check_adapter_name(name, self.base_name)
                ref = await asyncio.to_thread(self._lora.load, name, path, pinned=pinned)
            else:
                ref = await self._replace(name, path)
        except LoraPinError as e:
            log.warning("adapter %r: load refused: %s", name, e)
            raise
        with self._lock:
            # A replacement keeps the registration (and so its first path): the new weights' path is ours.
            self._paths[name] = path if replacing else ref.lora_path
        what = "replaced in place" if replacing else "loaded"
        log.info(
            "adapter %r: %s from %s (id %s%s)", name, what, path, ref.lora_id, ", pinned" if pinned else ""
        )

    async def _replace(self, name: str, path: str) -> LoRARef:
        """Replace ``name``'s weights once its requests have ended, its new requests held back."""
        while (earlier := self._replacing.get(name)) is not None:
            await earlier.wait()
        done = self._replacing[name] = asyncio.Event()
        log.info(
            "adapter %r: replacement from %s waits for its %d queued and running requests (new ones wait)",
            name,
            path,
            self._outstanding.get(name, 0),
        )
        try:
            await self._drained(name, "replacement")
            return await asyncio.to_thread(self._lora.load, name, path, replace=True)
        finally:
            del self._replacing[name]
            done.set()

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
            await self._drained(name, "unload")
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
