"""lora_pin's one exception hierarchy.

Every error lora_pin raises is a :class:`LoraPinError`. Where a standard exception already says what
kind of failure it is, the class also derives from it, so callers' existing ``except`` clauses work:
a bad spec is a ``ValueError``, an unknown adapter a ``KeyError``, an unload that timed out a
``TimeoutError``. The Rust core's error enum maps onto these classes in one exhaustive ``match``
(``rust/py/src/errors.rs``).
"""

from __future__ import annotations

__all__ = [
    "AdapterBusyError",
    "AdapterInUseError",
    "AdapterLoadError",
    "AdapterNotFoundError",
    "CapacityError",
    "DuplicateAdapterError",
    "LoraPinError",
    "OpArgumentError",
    "PathNotAllowedError",
    "PoolError",
    "SpecError",
    "StalePlanError",
    "UnloadTimeoutError",
    "UnsafeFormatError",
    "UsageError",
]


class LoraPinError(Exception):
    """The root of every error lora_pin raises."""


class SpecError(LoraPinError, ValueError):
    """An adapter spec or a limit is invalid; the message names the item (0-based index) and quotes it."""


class AdapterNotFoundError(LoraPinError, KeyError):
    """A name that is not registered was used; the message lists what is registered."""

    def __str__(self) -> str:
        # KeyError's __str__ shows repr(arg); a sentence reads better.
        return str(self.args[0]) if self.args else ""


class DuplicateAdapterError(LoraPinError, ValueError):
    """An adapter name is already registered; the message names both refs."""


class CapacityError(LoraPinError):
    """A pin, registration or load was refused: a tier would overflow. The message gives the numbers."""


class AdapterInUseError(LoraPinError):
    """The operation needs an adapter that no request is using (for example re-registering it)."""


class AdapterBusyError(LoraPinError):
    """An unload or replacement of an adapter whose leased requests did not end in time; nothing changed
    (the adapter serves on, on its old weights)."""


class UnloadTimeoutError(LoraPinError, TimeoutError):
    """An unload did not drain the adapter's in-flight requests in time; the adapter stays unregistered."""


class StalePlanError(LoraPinError):
    """A step plan refers to a slot whose contents changed after the plan was made.

    Attributes:
        stale_slots: the slots found stale (empty when the error is raised by ``finish``, whose
            message names them).
    """

    stale_slots: list[int]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.stale_slots = []


class UsageError(LoraPinError, ValueError):
    """A call contradicts the registry's state or itself: a release without an acquire, lists of different
    lengths, a load reported done that was never planned."""


class AdapterLoadError(LoraPinError, ValueError):
    """An adapter cannot be served; the message names the adapter, the file and the field or tensor."""


class UnsafeFormatError(AdapterLoadError):
    """An adapter is stored in an unsafe format (a pickle) and loading it was not explicitly allowed."""


class PathNotAllowedError(AdapterLoadError, PermissionError):
    """An adapter path resolves outside every allowed root."""


class OpArgumentError(LoraPinError, ValueError):
    """An argument of a ``lora_pin`` op has the wrong shape, dtype or device; the message names it."""


class PoolError(LoraPinError):
    """The device slot pool could not be allocated or filled; nothing was changed."""
