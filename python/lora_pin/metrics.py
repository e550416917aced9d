"""Prometheus metrics over a :class:`~lora_pin.model.LoRAManager` (the ``metrics`` extra).

``pip install 'lora_pin[metrics]'`` installs ``prometheus_client``; this module imports it only when a
collector is made, so ``import lora_pin.metrics`` stays cheap and works without it. Register a collector
once per manager; every scrape reads :meth:`LoRAManager.stats` afresh::

    from prometheus_client import REGISTRY
    from lora_pin.metrics import LoRAMetricsCollector

    REGISTRY.register(LoRAMetricsCollector(manager))

Metrics (``tier`` is ``device`` or ``host``; a slot is one device-tier place):

- ``lora_pin_pool_slots_used``, ``lora_pin_pool_slots_total``, ``lora_pin_pool_slots_utilization``: device
  slots holding an adapter, all slots, and their ratio (SGLang's ``lora_pool_slots_*``).
- ``lora_pin_adapters_registered``, ``lora_pin_adapters_pinned``: registered and pinned adapters.
- ``lora_pin_resident_adapters{tier}``, ``lora_pin_resident_bytes{tier}``: adapters and bytes a tier holds.
- ``lora_pin_tier_capacity_adapters{tier}``: a tier's capacity (the host tier's only when it is bounded).
- ``lora_pin_hits_total{tier}``, ``_misses_total``, ``_loads_total``, ``_evictions_total``,
  ``_refusals_total``: the tier counters of :meth:`LoRAManager.stats`.
- ``lora_pin_deferred_requests_total``: requests a step deferred to a later step (once per step deferred).
- ``lora_pin_adapter_load_seconds`` (summary: ``_count``, ``_sum``): reading an adapter from disk into host
  memory after start-up (loads, discovery, reads again after a host-tier eviction).
- ``lora_pin_background_loads_total``, ``lora_pin_background_load_failures_total``: reads the background
  loader ran off the steps' path and installed into the host tier, and those that failed;
  ``lora_pin_loads_in_flight``: its reads running or queued now.
- ``lora_pin_adapter_loaded{adapter, level, pinned}``: 1 per adapter resident at a level (``device``:
  in a slot, ``host``: in host memory, which every adapter in a slot is too), the shape routers read from
  vLLM's ``lora_adapter_loaded``; ``lora_pin_adapter_info{adapter, digest, generation}``: 1 per registered
  adapter, naming what it serves (:meth:`LoRAManager.identity`). Both read one
  :meth:`LoRAManager.placement` snapshot and are bounded: at most ``max_adapters`` adapters get series
  (pinned ones first, then by name); the rest are counted in ``lora_pin_adapters_unlisted{tier}``
  instead, so a server with thousands of adapters exports a bounded number of series.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_pin.model import LoRAManager

__all__ = ["DEFAULT_MAX_ADAPTERS", "LoRAMetricsCollector"]

DEFAULT_MAX_ADAPTERS = 64
_TIERS = ("device", "host")
_COUNTERS = ("hits", "misses", "loads", "evictions", "refusals")


def _prometheus_core() -> Any:
    """``prometheus_client.core``, or an error that names the extra to install."""
    try:
        return importlib.import_module("prometheus_client.core")
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != "prometheus_client":
            raise
        raise ModuleNotFoundError(
            "lora_pin.metrics needs prometheus_client, which is not installed; "
            "install it with: pip install 'lora_pin[metrics]'",
            name="prometheus_client",
        ) from e


class LoRAMetricsCollector:
    """A ``prometheus_client`` collector exposing one manager's counters and residency (see the module docs
    for the metric names).

    Args:
        manager: the manager to report on; every scrape calls its ``stats()``.
        max_adapters: the most adapters given a ``lora_pin_adapter_loaded`` series, at least 0.

    Raises:
        ModuleNotFoundError: prometheus_client is not installed (the message names the extra).
        ValueError: ``max_adapters`` is negative.
    """

    def __init__(self, manager: LoRAManager, *, max_adapters: int = DEFAULT_MAX_ADAPTERS) -> None:
        if max_adapters < 0:
            raise ValueError(f"max_adapters must be at least 0 (got {max_adapters})")
        self._core = _prometheus_core()
        self._manager = manager
        self.max_adapters = max_adapters

    def describe(self) -> list[Any]:
        """No metrics described up front: registering never scrapes the manager."""
        return []

    def collect(self) -> Iterator[Any]:
        """The metric families of one scrape, read from one ``manager.stats()`` call."""
        core = self._core
        stats = self._manager.stats()
        device, host = stats["device"], stats["host"]
        tiers = {"device": device, "host": host}

        def gauge(name: str, doc: str, value: float) -> Any:
            return core.GaugeMetricFamily(name, doc, value=value)

        yield gauge("lora_pin_pool_slots_used", "Device slots holding an adapter.", device["used"])
        yield gauge("lora_pin_pool_slots_total", "Device slots in the pool.", device["capacity"])
        utilization = device["used"] / device["capacity"] if device["capacity"] else 0.0
        yield gauge("lora_pin_pool_slots_utilization", "Share of device slots in use.", utilization)
        yield gauge("lora_pin_adapters_registered", "Registered adapters.", stats["registered"])
        yield gauge("lora_pin_adapters_pinned", "Pinned adapters.", stats["pinned"])

        per_tier = (
            ("lora_pin_resident_adapters", "Adapters a tier holds.", lambda t: len(t["resident"])),
            ("lora_pin_resident_bytes", "Bytes of the adapters a tier holds.", lambda t: t["bytes"]),
        )
        for name, doc, read in per_tier:
            family = core.GaugeMetricFamily(name, doc, labels=["tier"])
            for tier in _TIERS:
                family.add_metric([tier], read(tiers[tier]))
            yield family
        capacity = core.GaugeMetricFamily(
            "lora_pin_tier_capacity_adapters",
            "Adapters a tier can hold (bounded tiers only).",
            labels=["tier"],
        )
        for tier in _TIERS:
            if tiers[tier]["capacity"] is not None:
                capacity.add_metric([tier], tiers[tier]["capacity"])
        yield capacity

        for counter in _COUNTERS:
            family = core.CounterMetricFamily(
                f"lora_pin_{counter}", f"Adapter {counter} per tier since start.", labels=["tier"]
            )
            for tier in _TIERS:
                family.add_metric([tier], tiers[tier][counter])
            yield family
        yield core.CounterMetricFamily(
            "lora_pin_deferred_requests",
            "Requests deferred to a later step, counted once per step that deferred them.",
            value=stats["deferred_requests"],
        )
        yield core.CounterMetricFamily(
            "lora_pin_background_loads",
            "Adapter reads the background loader ran and installed into the host tier.",
            value=stats["background_loads"],
        )
        yield core.CounterMetricFamily(
            "lora_pin_background_load_failures",
            "Adapter reads the background loader ran that failed.",
            value=stats["background_load_failures"],
        )
        yield gauge(
            "lora_pin_loads_in_flight",
            "Background adapter reads running or queued.",
            stats["loads_in_flight"],
        )
        count, seconds = stats["adapter_reads"], stats["adapter_read_seconds"]
        yield core.SummaryMetricFamily(
            "lora_pin_adapter_load_seconds",
            "Seconds reading an adapter from disk into host memory, after start-up.",
            count_value=count,
            sum_value=seconds,
        )
        yield from self._per_adapter(core, stats)

    def _per_adapter(self, core: Any, stats: dict[str, Any]) -> Iterator[Any]:
        placement = self._manager.placement()
        levels = {
            "device": [a for a in placement.adapters if a.tier == "device"],
            "host": [a for a in placement.adapters if a.tier in ("device", "host")],
        }
        ranked = sorted(placement.adapters, key=lambda a: (not a.pinned, a.name))
        listed = {a.name for a in ranked[: self.max_adapters]}
        loaded = core.GaugeMetricFamily(
            "lora_pin_adapter_loaded",
            f"1 per adapter resident at a level (at most {self.max_adapters} adapters, pinned first).",
            labels=["adapter", "level", "pinned"],
        )
        unlisted = core.GaugeMetricFamily(
            "lora_pin_adapters_unlisted",
            "Adapters resident in a tier beyond the per-adapter series' cap.",
            labels=["tier"],
        )
        for level, resident in levels.items():
            for entry in resident:
                if entry.name in listed:
                    loaded.add_metric([entry.name, level, "true" if entry.pinned else "false"], 1)
            unlisted.add_metric([level], sum(a.name not in listed for a in resident))
        info = core.GaugeMetricFamily(
            "lora_pin_adapter_info",
            "1 per registered adapter, with the digest and generation it serves "
            f"(at most {self.max_adapters} adapters, pinned first).",
            labels=["adapter", "digest", "generation"],
        )
        for entry in ranked[: self.max_adapters]:
            info.add_metric([entry.name, entry.digest, str(entry.generation)], 1)
        yield loaded
        yield unlisted
        yield info
