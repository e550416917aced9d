"""Evictions per adapter and tier, in bounded memory: a server that sees an endless stream of adapter names
(``adapter_dir`` discovery) must not keep a counter for each, nor make every metrics scrape walk them."""

from __future__ import annotations

from collections import Counter

__all__ = ["MAX_EVICTION_KEYS", "TopEvictions"]

MAX_EVICTION_KEYS = 256
"""The most ``(adapter, tier)`` pairs counted one by one; the rest are summed in ``others``."""


class TopEvictions(Counter[tuple[str, str]]):
    """A ``Counter`` of evictions by ``(adapter, tier)`` holding at most ``cap`` keys.

    A new key arriving when the counter is full takes the place of the key with the fewest evictions,
    whose count moves to :attr:`others` (the "space saving" rule of heavy-hitter counting): the adapters
    evicted most stay listed, and ``sum(counts) + others`` is every eviction counted. The work per new key
    is O(``cap``) only while full; an existing key's increment is a dict update.

    Raises:
        ValueError: ``cap`` is below 1.
    """

    def __init__(self, cap: int = MAX_EVICTION_KEYS) -> None:
        if cap < 1:
            raise ValueError(f"cap must be at least 1 (got {cap})")
        super().__init__()
        self.cap = cap
        self.others = 0

    def __setitem__(self, key: tuple[str, str], value: int) -> None:
        if key not in self and len(self) >= self.cap:
            smallest = min(self, key=self.__getitem__)
            self.others += self[smallest]
            del self[smallest]
        super().__setitem__(key, value)
