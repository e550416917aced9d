"""The server's ``/metrics``: lora_pin's collector plus the requests the server answered.

Besides :class:`~lora_pin.metrics.LoRAMetricsCollector`'s metrics (slots, tiers, loads, evictions ...):

- ``lora_pin_serve_requests_total{adapter, outcome}``: requests answered (``ok``, ``error``), given up by
  their client before the answer (``cancelled``), refused for a full queue (``refused``);
- ``lora_pin_serve_time_to_first_token_seconds{adapter}``: histogram, from acceptance to the first token;
- ``lora_pin_serve_time_per_output_token_seconds{adapter}``: histogram, the mean gap between a request's
  later tokens;
- ``lora_pin_serve_requests_outstanding{adapter}``: queued and running requests now;
- ``lora_pin_serve_engine_requests{state}``: what the engine holds now
  (:class:`~lora_pin.serve.engine.EngineStats`): ``queued`` (the queue ``--max-queued-requests`` bounds),
  ``running``, ``tracked`` (its per-request records), ``result_handlers``;
- ``lora_pin_serve_prefix_cache_queries_total``, ``lora_pin_serve_prefix_cache_hit_tokens_total``: requests
  the prefix cache was asked about when they started, and the prompt tokens whose KV it gave them.

``adapter`` is the adapter's name, ``__base__`` for the base model, and ``__other__`` for adapters past the
series cap (``max_adapters`` distinct names get their own series, first come first served), so thousands of
adapters never mean thousands of series.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from lora_pin.metrics import DEFAULT_MAX_ADAPTERS, LoRAMetricsCollector

if TYPE_CHECKING:
    from lora_pin.model import LoRAManager
    from lora_pin.serve.engine import EngineStats, LoRAEngine

__all__ = ["BASE_LABEL", "OTHER_LABEL", "ServeMetrics", "StatusLog"]

log = logging.getLogger("lora_pin.serve")

BASE_LABEL = "__base__"
OTHER_LABEL = "__other__"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    """A Prometheus registry of its own for one server (``render()`` gives the scrape's text).

    Args:
        manager: the LoRA manager (None: LoRA off, only the request metrics).
        outstanding: returns the queued and running requests per adapter at each scrape.
        max_adapters: the cap on distinct adapter labels.
        engine_stats: returns what the engine holds, at each scrape (None: not exported).
        prefix_stats: returns the prefix cache's ``queries`` and ``hit_tokens``, at each scrape (None:
            not exported).
    """

    def __init__(
        self,
        manager: LoRAManager | None,
        outstanding: Callable[[], dict[str, int]],
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        engine_stats: Callable[[], EngineStats] | None = None,
        prefix_stats: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        if manager is not None:
            self.registry.register(LoRAMetricsCollector(manager, max_adapters=max_adapters))
        self.registry.register(_Outstanding(outstanding, self.label))
        if engine_stats is not None:
            self.registry.register(_EngineRequests(engine_stats))
        if prefix_stats is not None:
            self.registry.register(_PrefixCache(prefix_stats))
        self._max_adapters = max_adapters
        self._labels: set[str] = set()
        self._lock = threading.Lock()
        self.requests = Counter(
            "lora_pin_serve_requests", "Requests answered", ["adapter", "outcome"], registry=self.registry
        )
        self.ttft = Histogram(
            "lora_pin_serve_time_to_first_token_seconds",
            "From a request's acceptance to its first token",
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "lora_pin_serve_time_per_output_token_seconds",
            "Mean time between a request's tokens after the first",
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def label(self, adapter: str | None) -> str:
        """The ``adapter`` label of ``adapter`` (None: the base), within the series cap."""
        if adapter is None:
            return BASE_LABEL
        with self._lock:
            if adapter in self._labels:
                return adapter
            if len(self._labels) < self._max_adapters:
                self._labels.add(adapter)
                return adapter
        return OTHER_LABEL

    def observe(self, adapter: str | None, ok: bool, ttft: float | None, tpot: float | None) -> None:
        """Count one answered request, with its latencies when it produced tokens."""
        label = self.label(adapter)
        self.requests.labels(label, "ok" if ok else "error").inc()
        if ttft is not None:
            self.ttft.labels(label).observe(ttft)
        if tpot is not None:
            self.tpot.labels(label).observe(tpot)

    def count(self, adapter: str | None, outcome: str) -> None:
        """Count one request that got no answer: ``cancelled`` by its client, ``refused`` at the door."""
        self.requests.labels(self.label(adapter), outcome).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


class _Outstanding:
    """``lora_pin_serve_requests_outstanding{adapter}``, read at each scrape."""

    def __init__(self, outstanding: Callable[[], dict[str, int]], label: Callable[[str | None], str]) -> None:
        self._outstanding = outstanding
        self._label = label

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "lora_pin_serve_requests_outstanding", "Queued and running requests", labels=["adapter"]
        )
        by_label: dict[str, int] = {}
        for name, count in self._outstanding().items():
            label = self._label(None if name == BASE_LABEL else name)
            by_label[label] = by_label.get(label, 0) + count
        for label, count in sorted(by_label.items()):
            family.add_metric([label], count)
        yield family


class _EngineRequests:
    """``lora_pin_serve_engine_requests{state}``, read at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from dataclasses import asdict

        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "lora_pin_serve_engine_requests", "Requests the engine holds, by state", labels=["state"]
        )
        for state, count in asdict(self._stats()).items():
            family.add_metric([state], count)
        yield family


class _PrefixCache:
    """The prefix cache's counters, read at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        stats = self._stats()
        yield CounterMetricFamily(
            "lora_pin_serve_prefix_cache_queries",
            "Requests looked up in the prefix cache when they started",
            value=stats["queries"],
        )
        yield CounterMetricFamily(
            "lora_pin_serve_prefix_cache_hit_tokens",
            "Prompt tokens whose KV the prefix cache gave (not computed)",
            value=stats["hit_tokens"],
        )


class StatusLog:
    """One ``lora_pin.serve`` log line every ``interval`` seconds while requests run or adapters move:
    requests running and waiting, output tokens per second, adapters resident in device slots and
    pinned, and the adapter loads and evictions since the last line (a daemon thread, :meth:`start`)."""

    def __init__(self, engine: LoRAEngine, manager: LoRAManager | None, interval: float) -> None:
        self.engine, self.manager, self.interval = engine, manager, interval
        self._last = (time.monotonic(), 0, 0, 0)

    def start(self) -> None:
        threading.Thread(target=self._run, name="lora_pin-status-log", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            try:
                line = self.line()
            except RuntimeError as e:  # a counter changed while it was read: the next line has it
                log.debug("status line skipped: %s", e)
                continue
            if line is not None:
                log.info("%s", line)

    def line(self) -> str | None:
        """The status since the last call; None when nothing ran and nothing moved."""
        now, tokens = time.monotonic(), self.engine.sampler.tokens_generated
        resident = pinned = loads = evictions = 0
        if self.manager is not None:
            stats = self.manager.stats()
            resident, pinned = len(stats["device"]["resident"]), len(stats["pinned_names"])
            loads = int(stats["device"]["loads"])
            evictions = sum(self.manager.evictions().values())
        then, last_tokens, last_loads, last_evictions = self._last
        self._last = (now, tokens, loads, evictions)
        held = self.engine.stats()
        if not (held.running or held.queued or tokens - last_tokens or loads - last_loads):
            return None
        rate = (tokens - last_tokens) / max(now - then, 1e-9)
        return (
            f"status: {held.running} running, {held.queued} waiting, {rate:.1f} output tokens/s; "
            f"adapters: {resident} in device slots, {pinned} pinned; since the last line: "
            f"{loads - last_loads} slot loads, {evictions - last_evictions} evictions"
        )
