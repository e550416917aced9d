"""Adapters at run time: loads, unloads, pins and unpins over HTTP, and the requests each adapter has.

Every request is counted from the moment it is accepted until its last output: it holds a lease
(:class:`~lora_pin.model.leases.RequestLease`, from :meth:`AdapterAdmin.acquire`) whose release is
idempotent. The leases are the manager's (:attr:`LoRAManager.leases`), and so is the one drain over
them: an unload (:meth:`LoRAManager.unload_async`) first stops new requests for the adapter (they get 404,
as for an unknown adapter), then waits for its queued and running requests to end, and only then unloads
it, so no request is failed by an unload.

A request keeps its version: a replacement of an adapter's weights (``load(..., replace=True)``, vLLM's
``load_inplace``; :meth:`LoRAManager.load_async`) holds new requests of that adapter back, waits for its
queued and running requests to end, then replaces the weights; the held requests then start on the new
weights, as does every request accepted after the call returns. So every request runs from its first token
to its last on one version's weights (and its prefix-cache key is that version's digest). A replacement
whose requests do not end within the drain timeout is refused (:class:`AdapterBusyError`) and the old
weights serve on.

This module adds what a server alone needs: the names it accepts, the paths it reports, and one log line
on the ``lora_pin.serve`` logger for each adapter event (load, replacement, unload, pin, unpin, refusal),
at the time it happens; evictions are logged by the engine after the step that made them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lora_pin.errors import AdapterBusyError, AdapterNotFoundError, LoraPinError, SpecError
from lora_pin.model.leases import RequestLease, RequestLeases
from lora_pin.serve.metrics import BASE_LABEL

if TYPE_CHECKING:
    from lora_pin._core import LoRARef
    from lora_pin.model import LoRAManager

__all__ = ["MAX_ADAPTER_NAME_CHARS", "AdapterAdmin", "AdapterBusyError", "Lease", "check_adapter_name"]

#: A request's hold on its adapter (the manager's :class:`~lora_pin.model.leases.RequestLease`).
Lease = RequestLease

log = logging.getLogger("lora_pin.serve")

# How long an unload (or a replacement) waits for the adapter's queued and running requests.
DEFAULT_UNLOAD_TIMEOUT_S = 120.0
# The longest adapter name the server registers (vLLM and SGLang set none; a request names it whole).
MAX_ADAPTER_NAME_CHARS = 256


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


class AdapterAdmin:
    """The server's view of ``manager``'s adapters: which accept requests, and how many each has (both
    read from the manager's leases; without a manager only the base model is served).

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
        self.leases = RequestLeases() if manager is None else manager.leases
        # name -> path of every adapter registered through this server (the registry lists no names).
        self._paths: dict[str, str] = {r.lora_name: r.lora_path for r in startup}
        self.unload_timeout = unload_timeout
        self._lock = threading.Lock()

    @property
    def _lora(self) -> LoRAManager:
        if self.manager is None:
            raise AdapterNotFoundError("LoRA is off on this server (no adapter can be loaded)")
        return self.manager

    def _registered(self, name: str) -> bool:
        """Whether ``name`` is registered (or being unloaded) in the manager."""
        if self.manager is None:
            return False
        try:
            self.manager.identity(name)
        except AdapterNotFoundError:
            return False
        return True

    def serves(self, name: str) -> bool:
        """Whether requests for ``name`` are accepted now (registered, not being unloaded)."""
        return self.leases.serves(name)

    async def acquire(self, name: str | None) -> Lease | None:
        """Count one request for ``name`` (None: the base) and return its lease; None if ``name`` is not
        served now. Waits while ``name``'s weights are being replaced (the request then gets the new
        ones)."""
        return await self.leases.acquire(name)

    def outstanding(self) -> dict[str, int]:
        """Queued and running requests per adapter (``__base__``: the base model; none: left out)."""
        return {BASE_LABEL if n is None else n: c for n, c in self.leases.outstanding().items()}

    def served(self) -> dict[str, str]:
        """The adapters that accept requests and their paths, by name."""
        with self._lock:
            paths = sorted(self._paths.items())
        return {n: p for n, p in paths if self.leases.serves(n)}

    async def load(self, name: str, path: str, *, pinned: bool = False, replace: bool = False) -> None:
        """Load the adapter at ``path`` as ``name`` (read on a worker thread); with ``replace``, replace a
        registered ``name``'s weights in place once its requests have ended, holding its new requests
        back meanwhile (:meth:`LoRAManager.load_async`).

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
            else:
                log.info(
                    "adapter %r: replacement from %s waits for its %d queued and running requests "
                    "(new ones wait)",
                    name,
                    path,
                    self.leases.outstanding().get(name, 0),
                )
            ref = await self._lora.load_async(
                name, path, pinned=pinned, replace=replacing, timeout=self.unload_timeout
            )
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

    async def unload(self, name: str) -> None:
        """Stop new requests for ``name``, wait for its queued and running ones, then unload it
        (:meth:`LoRAManager.unload_async`).

        Raises:
            AdapterNotFoundError: ``name`` is not registered (or is being unloaded already).
            AdapterBusyError: its requests did not end within the unload timeout; it serves again.
        """
        if not self.serves(name):
            log.warning("adapter %r: unload refused: not loaded", name)
            raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
        try:
            await self._lora.unload_async(name, self.unload_timeout)
        except AdapterNotFoundError:
            log.warning("adapter %r: unload refused: not loaded", name)
            raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.") from None
        except AdapterBusyError:
            log.warning("adapter %r: unload refused: its requests did not end in time", name)
            raise
        with self._lock:
            self._paths.pop(name, None)
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
