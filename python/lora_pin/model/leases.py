"""Requests counted per adapter from their acceptance to their last output, and the one drain over them.

The core counts the requests a step acquired (from ``begin_step`` to ``finish_step``); a server's request
lives longer: it waits in the engine's queue between steps and streams after its last step. A
:class:`RequestLease` covers that whole life, so an unload or a replacement that waits for an adapter's
leases also waits for every step of theirs. :class:`RequestLeases` is the one place that counts them:
the manager owns one (:attr:`LoRAManager.leases <lora_pin.model.LoRAManager>`), and its
:meth:`~lora_pin.model.LoRAManager.unload_async` and :meth:`~lora_pin.model.LoRAManager.load_async`
drain through it before the core drains its own in-step requests (by then at most the step that ran the
last token).

An adapter *closed* to new leases (an unload waiting for its requests) is not served: :meth:`acquire`
answers None, as for a name not registered. An adapter being *replaced* holds new leases back until
the replacement is over, so every request runs from its first token to its last on one version's
weights (and its prefix-cache key, :attr:`RequestLease.digest`, is that version's digest).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable

from lora_pin.errors import AdapterBusyError

__all__ = ["DRAIN_POLL_S", "RequestLease", "RequestLeases"]

#: How often a drain looks at the count again (the count decides; this only paces the looking).
DRAIN_POLL_S = 0.01


class RequestLease:
    """One request's hold on its adapter (or on the base model), from acceptance to its last output.

    Attributes:
        name: the adapter (None: the base model).
        digest: the content digest of the weights it runs with (None: the base model): its prefix-cache
            key. Fixed for the lease's life: a replacement waits for every lease of the adapter.
    """

    def __init__(self, leases: RequestLeases, name: str | None, digest: str | None) -> None:
        self._leases, self.name, self.digest = leases, name, digest
        self._released = False

    def release(self) -> None:
        """End the hold (again: nothing)."""
        if not self._released:
            self._released = True
            self._leases._release(self.name)


class RequestLeases:
    """The requests of each adapter from acceptance to their last output (module docs).

    Args:
        digest_of: an adapter's content digest, None when it is not registered (a manager's: from its
            identities; without a manager every adapter is unknown and only the base is leased).

    Thread safety: every method may be called from any thread; :meth:`acquire`, :meth:`drained` and
    :meth:`replacing` are coroutines of one event loop.
    """

    def __init__(self, digest_of: Callable[[str], str | None] = lambda name: None) -> None:
        self._digest_of = digest_of
        self._lock = threading.Lock()
        self._count: Counter[str | None] = Counter()
        self._closed: set[str] = set()
        # Adapters whose weights are being replaced -> set once the replacement is over.
        self._replacing: dict[str, asyncio.Event] = {}

    def serves(self, name: str) -> bool:
        """Whether a request for ``name`` gets a lease now (registered, not closed by an unload)."""
        with self._lock:
            return name not in self._closed and self._digest_of(name) is not None

    async def acquire(self, name: str | None) -> RequestLease | None:
        """Count one request for ``name`` (None: the base) and return its lease; None if ``name`` is not
        served now. Waits while ``name``'s weights are being replaced (the request then gets the new
        ones)."""
        if name is None:
            with self._lock:
                self._count[None] += 1
            return RequestLease(self, None, None)
        while (replacing := self._replacing.get(name)) is not None:
            await replacing.wait()
        with self._lock:
            digest = self._digest_of(name)
            if name in self._closed or digest is None:
                return None
            self._count[name] += 1
            return RequestLease(self, name, digest)

    def _release(self, name: str | None) -> None:
        with self._lock:
            self._count[name] -= 1
            if self._count[name] <= 0:
                del self._count[name]

    def outstanding(self) -> dict[str | None, int]:
        """Leased requests per adapter (None: the base model; adapters with none left out)."""
        with self._lock:
            return dict(self._count)

    def close(self, name: str) -> bool:
        """Stop new leases of ``name``; False (and nothing changes) if it is closed already or not
        registered."""
        with self._lock:
            if name in self._closed or self._digest_of(name) is None:
                return False
            self._closed.add(name)
            return True

    def reopen(self, name: str) -> None:
        """Undo :meth:`close` (an unload that ended, or gave up)."""
        with self._lock:
            self._closed.discard(name)

    async def drained(self, name: str, timeout: float | None, what: str) -> None:
        """Returns once ``name`` has no lease.

        Raises:
            AdapterBusyError: some are still held after ``timeout`` seconds (None: no limit); nothing
                changed.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while (held := self.outstanding().get(name, 0)) > 0:
            if deadline is not None and loop.time() > deadline:
                raise AdapterBusyError(
                    f"{what} of adapter {name!r} refused: it still has {held} requests after "
                    f"{timeout:g} s; nothing changed"
                )
            await asyncio.sleep(DRAIN_POLL_S)

    @contextlib.asynccontextmanager
    async def replacing(self, name: str, timeout: float | None) -> AsyncIterator[None]:
        """Hold ``name``'s new leases back, wait for its leases to end (after an earlier replacement of
        it), run the body, then let the held requests go on.

        Raises:
            AdapterBusyError: its leases did not end within ``timeout`` (the body does not run).
        """
        while (earlier := self._replacing.get(name)) is not None:
            await earlier.wait()
        done = self._replacing[name] = asyncio.Event()
        try:
            await self.drained(name, timeout, "replacement")
            yield
        finally:
            del self._replacing[name]
            done.set()
