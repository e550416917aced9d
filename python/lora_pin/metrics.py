"""Prometheus metrics over a :class:`~lora_pin.model.LoRAManager` (the ``metrics`` extra).

``pip install 'lora_pin[metrics]'`` installs ``prometheus_client``; this module imports it only when a
collector is made, so ``import lora_pin.metrics`` stays cheap and works without it. Register one collector
per registry; every scrape reads :meth:`LoRAManager.stats` afresh::

    from prometheus_client import REGISTRY
    from lora_pin.metrics import LoRAMetricsCollector

    REGISTRY.register(LoRAMetricsCollector(manager))

Several managers (one per model) share one collector, told apart by constant labels on every series::

    collector = LoRAMetricsCollector(llama_manager, labels={"model": "llama"})
    collector.add(qwen_manager, labels={"model": "qwen"})
    REGISTRY.register(collector)

The collector describes its metric families, so a registry refuses a second collector of the same names
(``ValueError: Duplicated timeseries``) instead of exporting every series twice.

Metrics (``tier`` is ``device`` or ``host``; a slot is one device-tier place):

- ``lora_pin_pool_slots_used``, ``lora_pin_pool_slots_total``, ``lora_pin_pool_slots_utilization``: device
  slots holding an adapter, all slots, and their ratio (SGLang's ``lora_pool_slots_*``).
- ``lora_pin_adapters_registered``, ``lora_pin_adapters_pinned``: registered and pinned adapters.
- ``lora_pin_resident_adapters{tier}``, ``lora_pin_resident_bytes{tier}``: adapters and bytes a tier holds.
- ``lora_pin_tier_capacity_adapters{tier}``: a tier's capacity (the host tier's only when it is bounded).
- ``lora_pin_hits_total{tier}``, ``_misses_total``, ``_loads_total``, ``_evictions_total``,
  ``_refusals_total``: the tier counters of :meth:`LoRAManager.stats`.
- ``lora_pin_deferred_requests_total``: requests a step deferred to a later step (once per step deferred).
- ``lora_pin_steps_total``: steps planned; ``lora_pin_hits_total{tier="device"}`` plus ``_misses_total``
  over it is the mean number of distinct adapters a step used.
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
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_pin.model import LoRAManager

__all__ = ["DEFAULT_MAX_ADAPTERS", "LoRAMetricsCollector"]

DEFAULT_MAX_ADAPTERS = 64
_TIERS = ("device", "host")
_COUNTERS = ("hits", "misses", "loads", "evictions", "refusals")
_OWN_LABELS = ("tier", "level", "adapter", "pinned", "digest", "generation")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


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
    """A ``prometheus_client`` collector exposing the counters and residency of one or more managers (see
    the module docs for the metric names).

    Args:
        manager: the manager to report on; every scrape calls its ``stats()``.
        labels: constant labels put on every series of ``manager`` (``{"model": "llama"}``), so that
            the managers :meth:`add` joins to this collector are told apart.
        max_adapters: the most adapters given a ``lora_pin_adapter_loaded`` series per manager, at least 0.

    Raises:
        ModuleNotFoundError: prometheus_client is not installed (the message names the extra).
        ValueError: ``max_adapters`` is negative, or ``labels`` is invalid (see :meth:`add`).
    """

    def __init__(
        self,
        manager: LoRAManager,
        *,
        labels: Mapping[str, str] | None = None,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
    ) -> None:
        if max_adapters < 0:
            raise ValueError(f"max_adapters must be at least 0 (got {max_adapters})")
        self._core = _prometheus_core()
        self.max_adapters = max_adapters
        self._label_names = sorted(labels or {})
        self._managers: list[tuple[list[str], LoRAManager]] = []
        self.add(manager, labels=labels)

    def add(self, manager: LoRAManager, *, labels: Mapping[str, str] | None = None) -> None:
        """Reports on ``manager`` too, its series carrying ``labels`` (a registry takes one collector per
        set of metric names, so managers of one process share a collector).

        Raises:
            ValueError: ``labels`` names other labels than the first manager's, a label lora_pin's metrics
                use themselves (``tier``, ``adapter``, ``pinned``) or an invalid Prometheus label
                name, holds a value that is not a str, or repeats another manager's values.
        """
        labels = dict(labels or {})
        if sorted(labels) != self._label_names:
            raise ValueError(
                f"every manager of a collector needs the same label names: got {sorted(labels)}, this "
                f"collector's are {self._label_names}"
            )
        for name, value in labels.items():
            if name in _OWN_LABELS:
                raise ValueError(
                    f"{name!r} is a label lora_pin's metrics use; name the constant label otherwise"
                )
            if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)")
            if not isinstance(value, str):
                raise ValueError(f"label {name!r} must have a str value, got {type(value).__name__}")
        values = [labels[n] for n in self._label_names]
        if any(values == other for other, _ in self._managers):
            raise ValueError(
                f"a manager with labels {labels} is already in this collector; give each manager its own "
                "values"
            )
        self._managers.append((values, manager))

    def describe(self) -> list[Any]:
        """The metric families (names, types, labels) without samples: registering never scrapes a manager,
        and a registry can refuse a second collector of the same names."""
        return list(self._families([], []))

    def collect(self) -> Iterator[Any]:
        """The metric families of one scrape, read from one ``stats()`` call per manager."""
        rows = [(values, manager.stats()) for values, manager in self._managers]
        placements = [(values, manager.placement()) for values, manager in self._managers]
        return self._families(rows, placements)

    def _families(
        self, rows: list[tuple[list[str], dict[str, Any]]], placements: list[tuple[list[str], Any]]
    ) -> Iterator[Any]:
        """The metric families holding one sample set per ``(label values, stats)`` row."""
        core, names = self._core, self._label_names

        def family(kind: Any, name: str, doc: str, read: Callable[[dict[str, Any]], float]) -> Any:
            made = kind(name, doc, labels=names)
            for values, stats in rows:
                made.add_metric(values, read(stats))
            return made

        def gauge(name: str, doc: str, read: Callable[[dict[str, Any]], float]) -> Any:
            return family(core.GaugeMetricFamily, name, doc, read)

        def per_tier(kind: Any, name: str, doc: str, read: Callable[[dict[str, Any]], float | None]) -> Any:
            made = kind(name, doc, labels=[*names, "tier"])
            for values, stats in rows:
                for tier in _TIERS:
                    value = read(stats[tier])
                    if value is not None:
                        made.add_metric([*values, tier], value)
            return made

        yield gauge(
            "lora_pin_pool_slots_used", "Device slots holding an adapter.", lambda s: s["device"]["used"]
        )
        yield gauge(
            "lora_pin_pool_slots_total", "Device slots in the pool.", lambda s: s["device"]["capacity"]
        )
        yield gauge("lora_pin_pool_slots_utilization", "Share of device slots in use.", _utilization)
        yield gauge("lora_pin_adapters_registered", "Registered adapters.", lambda s: s["registered"])
        yield gauge("lora_pin_adapters_pinned", "Pinned adapters.", lambda s: s["pinned"])
        gauge_family = core.GaugeMetricFamily
        yield per_tier(
            gauge_family, "lora_pin_resident_adapters", "Adapters a tier holds.", lambda t: len(t["resident"])
        )
        yield per_tier(
            gauge_family,
            "lora_pin_resident_bytes",
            "Bytes of the adapters a tier holds.",
            lambda t: t["bytes"],
        )
        yield per_tier(
            gauge_family,
            "lora_pin_tier_capacity_adapters",
            "Adapters a tier can hold (bounded tiers only).",
            lambda t: t["capacity"],
        )
        for counter in _COUNTERS:
            yield per_tier(
                core.CounterMetricFamily,
                f"lora_pin_{counter}",
                f"Adapter {counter} per tier since start.",
                lambda t, counter=counter: t[counter],
            )
        counter_family = core.CounterMetricFamily
        yield family(
            counter_family,
            "lora_pin_deferred_requests",
            "Requests deferred to a later step, counted once per step that deferred them.",
            lambda s: s["deferred_requests"],
        )
        yield family(counter_family, "lora_pin_steps", "Steps planned.", lambda s: s["steps"])
        yield family(
            counter_family,
            "lora_pin_background_loads",
            "Adapter reads the background loader ran and installed into the host tier.",
            lambda s: s["background_loads"],
        )
        yield family(
            counter_family,
            "lora_pin_background_load_failures",
            "Adapter reads the background loader ran that failed.",
            lambda s: s["background_load_failures"],
        )
        yield gauge(
            "lora_pin_loads_in_flight",
            "Background adapter reads running or queued.",
            lambda s: s["loads_in_flight"],
        )
        reads = core.SummaryMetricFamily(
            "lora_pin_adapter_load_seconds",
            "Seconds reading an adapter from disk into host memory, after start-up.",
            labels=names,
        )
        for values, stats in rows:
            reads.add_metric(
                values, count_value=stats["adapter_reads"], sum_value=stats["adapter_read_seconds"]
            )
        yield reads
        yield from self._per_adapter(core, placements)

    def _per_adapter(self, core: Any, placements: list[tuple[list[str], Any]]) -> Iterator[Any]:
        names = self._label_names
        loaded = core.GaugeMetricFamily(
            "lora_pin_adapter_loaded",
            f"1 per adapter resident at a level (at most {self.max_adapters} adapters, pinned first).",
            labels=[*names, "adapter", "level", "pinned"],
        )
        unlisted = core.GaugeMetricFamily(
            "lora_pin_adapters_unlisted",
            "Adapters resident in a tier beyond the per-adapter series' cap.",
            labels=[*names, "tier"],
        )
        info = core.GaugeMetricFamily(
            "lora_pin_adapter_info",
            "1 per registered adapter, with the digest and generation it serves "
            f"(at most {self.max_adapters} adapters, pinned first).",
            labels=[*names, "adapter", "digest", "generation"],
        )
        for values, placement in placements:
            levels = {
                "device": [a for a in placement.adapters if a.tier == "device"],
                "host": [a for a in placement.adapters if a.tier in ("device", "host")],
            }
            ranked = sorted(placement.adapters, key=lambda a: (not a.pinned, a.name))
            listed = {a.name for a in ranked[: self.max_adapters]}
            for level, resident in levels.items():
                for entry in resident:
                    if entry.name in listed:
                        pinned = "true" if entry.pinned else "false"
                        loaded.add_metric([*values, entry.name, level, pinned], 1)
                unlisted.add_metric([*values, level], sum(a.name not in listed for a in resident))
            for entry in ranked[: self.max_adapters]:
                info.add_metric([*values, entry.name, entry.digest, str(entry.generation)], 1)
        yield loaded
        yield unlisted
        yield info


def _utilization(stats: dict[str, Any]) -> float:
    device = stats["device"]
    return device["used"] / device["capacity"] if device["capacity"] else 0.0
