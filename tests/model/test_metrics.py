"""``lora_pin.metrics``: the Prometheus text a scrape gives after real steps, checked against
``LoRAManager.stats()``; the per-adapter cap; and the module without prometheus_client."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lora_pin import LoRAManager
from lora_pin.metrics import LoRAMetricsCollector

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, make_adapters: Callable[..., dict[str, Path]]) -> Any:
    specs = {f"a{i}": dict(r=2 + i % 3, lora_alpha=8, target_modules=ATTN, seed=i) for i in range(5)}
    return make_adapters(tmp_path_factory.mktemp("metrics"), specs)


def scrape(collector: LoRAMetricsCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape of the text format, by name and sorted labels."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def served_manager(tiny_llama: torch.nn.Module, adapters: dict[str, Path]) -> LoRAManager:
    """Three slots (one pinned), a host tier of 3, two adapters loaded after start-up, and steps that
    defer requests, evict from both tiers and read an adapter again from disk."""
    model = copy.deepcopy(tiny_llama)
    startup = [{"lora_name": "a0", "lora_path": str(adapters["a0"]), "pinned": True}, f"a1={adapters['a1']}"]
    mgr = LoRAManager(
        model, startup, max_loras_per_batch=3, max_loaded_loras=3, max_lora_rank=4, lora_target_modules=ATTN
    )
    mgr.load("a2", adapters["a2"])
    mgr.load("a3", adapters["a3"])
    # The counters come from planning and loading; no forward is needed for them.
    for names in (["a0", "a1", "a2", "a3", None], ["a3", "a2", "a1"], ["a1", "a0"], ["a2", "a3", "a1", "a0"]):
        mgr.finish(mgr.prepare_step(names, 1))
    # The reads those steps began in the background end, enter the host tier and take their requests.
    assert mgr.wait_loads(timeout=30)
    mgr.finish(mgr.prepare_step(["a2", "a3"], 1))
    # Installing those reads evicted others, which that step may have begun reading again.
    assert mgr.wait_loads(timeout=30)
    # One adapter a step, each read in before its step: the two unpinned slots turn over.
    for name in ("a1", "a2", "a3", "a1"):
        mgr.prefetch([name])
        assert mgr.wait_loads(timeout=30)
        mgr.finish(mgr.prepare_step([name], 1))
    return mgr


def test_a_scrape_reports_what_stats_says(tiny_llama: torch.nn.Module, adapters: dict[str, Path]) -> None:
    mgr = served_manager(tiny_llama, adapters)
    samples = scrape(LoRAMetricsCollector(mgr))
    stats = mgr.stats()

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    dev, host = stats["device"], stats["host"]
    assert value("lora_pin_pool_slots_total") == 3 == dev["capacity"]
    assert value("lora_pin_pool_slots_used") == dev["used"] == len(dev["resident"])
    assert value("lora_pin_pool_slots_utilization") == pytest.approx(dev["used"] / 3)
    assert value("lora_pin_adapters_registered") == stats["registered"] == 4
    assert value("lora_pin_adapters_pinned") == stats["pinned"] == 1
    for tier, t in (("device", dev), ("host", host)):
        assert value("lora_pin_resident_adapters", tier=tier) == len(t["resident"])
        assert value("lora_pin_resident_bytes", tier=tier) == t["bytes"] > 0
        assert value("lora_pin_tier_capacity_adapters", tier=tier) == t["capacity"]
        for counter in ("hits", "misses", "loads", "evictions", "refusals"):
            assert value(f"lora_pin_{counter}_total", tier=tier) == t[counter], (tier, counter)
    # The steps did evict from both tiers and defer requests: the numbers checked are not all zero.
    assert dev["evictions"] > 0 and host["evictions"] > 0
    assert value("lora_pin_deferred_requests_total") == stats["deferred_requests"] > 0
    assert value("lora_pin_steps_total") == stats["steps"] == 9
    # a2 and a3 were read at load time, and at least one was read again after a host eviction.
    assert value("lora_pin_adapter_load_seconds_count") == stats["adapter_reads"] >= 3
    assert value("lora_pin_adapter_load_seconds_sum") == pytest.approx(stats["adapter_read_seconds"])
    assert stats["adapter_read_seconds"] > 0
    assert value("lora_pin_background_loads_total") == stats["background_loads"] > 0
    assert value("lora_pin_background_load_failures_total") == stats["background_load_failures"] == 0
    assert value("lora_pin_loads_in_flight") == stats["loads_in_flight"] == 0
    for tier, t in (("device", dev), ("host", host)):
        for name in t["resident"]:
            pinned = "true" if name in stats["pinned_names"] else "false"
            assert value("lora_pin_adapter_loaded", adapter=name, level=tier, pinned=pinned) == 1
        assert value("lora_pin_adapters_unlisted", tier=tier) == 0
    loaded = [k for k in samples if k[0] == "lora_pin_adapter_loaded"]
    assert len(loaded) == len(dev["resident"]) + len(host["resident"])
    for name, identity in stats["identities"].items():
        labels = {"adapter": name, "digest": identity["digest"], "generation": str(identity["generation"])}
        assert value("lora_pin_adapter_info", **labels) == 1
    assert len([k for k in samples if k[0] == "lora_pin_adapter_info"]) == len(stats["identities"]) == 4
    # A replacement shows in the next scrape: same adapter, a new digest and generation.
    before = stats["identities"]["a1"]
    mgr.load("a1", adapters["a4"], replace=True)
    after = mgr.stats()["identities"]["a1"]
    assert after["generation"] == before["generation"] + 1 and after["digest"] != before["digest"]
    samples = scrape(LoRAMetricsCollector(mgr))
    info = {dict(k[1])["adapter"]: dict(k[1]) for k in samples if k[0] == "lora_pin_adapter_info"}
    assert (info["a1"]["digest"], info["a1"]["generation"]) == (after["digest"], str(after["generation"]))


def test_deferred_requests_count_once_per_step(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    mgr = LoRAManager(
        copy.deepcopy(tiny_llama), [f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=2
    )
    for _ in range(3):
        step = mgr.prepare_step(["a0", "a1", "a2", "a2", "a3"], 1)
        mgr.finish(step)
        assert len(step.deferred) == 3
    stats = mgr.stats()
    assert stats["deferred_requests"] == 9
    # Two adapters in each of three steps: the uses per step that serve_load reports.
    assert stats["steps"] == 3
    assert stats["device"]["hits"] + stats["device"]["misses"] == 2 * 3


def test_per_adapter_series_are_capped_pinned_first(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    mgr = served_manager(tiny_llama, adapters)
    stats = mgr.stats()
    samples = scrape(LoRAMetricsCollector(mgr, max_adapters=1))
    loaded = {dict(k[1])["adapter"] for k in samples if k[0] == "lora_pin_adapter_loaded"}
    assert loaded == {"a0"}, "the one series goes to the pinned adapter"
    assert {dict(k[1])["adapter"] for k in samples if k[0] == "lora_pin_adapter_info"} == {"a0"}
    for tier in ("device", "host"):
        resident = stats[tier]["resident"]
        unlisted = samples[("lora_pin_adapters_unlisted", (("tier", tier),))]
        assert unlisted == len([n for n in resident if n != "a0"]) > 0
    with pytest.raises(ValueError, match="max_adapters"):
        LoRAMetricsCollector(mgr, max_adapters=-1)


def test_without_prometheus_client_the_error_names_the_extra() -> None:
    script = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None\n"
        "import lora_pin.metrics\n"
        "assert 'torch' not in sys.modules, 'importing lora_pin.metrics stays light'\n"
        "try:\n"
        "    lora_pin.metrics.LoRAMetricsCollector(None)\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("prometheus_client ")
    assert "pip install 'lora_pin[metrics]'" in out.stdout


def test_a_second_collector_on_the_same_names_is_refused_not_duplicated(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    mgr = LoRAManager(copy.deepcopy(tiny_llama), [f"a0={adapters['a0']}"], lora_target_modules=ATTN)
    registry = CollectorRegistry()
    registry.register(LoRAMetricsCollector(mgr))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(LoRAMetricsCollector(mgr))


def test_two_managers_in_one_registry_are_told_apart_by_a_constant_label(
    tiny_llama: torch.nn.Module, adapters: dict[str, Path]
) -> None:
    one = LoRAManager(copy.deepcopy(tiny_llama), [f"a0={adapters['a0']}"], lora_target_modules=ATTN)
    two = LoRAManager(
        copy.deepcopy(tiny_llama),
        [f"a1={adapters['a1']}", f"a2={adapters['a2']}"],
        max_loras_per_batch=3,
        lora_target_modules=ATTN,
    )
    two.finish(two.prepare_step(["a1", "a2", "a1"], 1))
    collector = LoRAMetricsCollector(one, labels={"model": "llama"})
    collector.add(two, labels={"model": "qwen"})
    samples = scrape(collector)
    for model, mgr in (("llama", one), ("qwen", two)):
        stats = mgr.stats()
        assert samples[("lora_pin_pool_slots_total", (("model", model),))] == stats["device"]["capacity"]
        assert samples[("lora_pin_adapters_registered", (("model", model),))] == stats["registered"]
        key = ("lora_pin_hits_total", (("model", model), ("tier", "device")))
        assert samples[key] == stats["device"]["hits"]
        for name in stats["device"]["resident"]:
            key = (
                "lora_pin_adapter_loaded",
                (("adapter", name), ("level", "device"), ("model", model), ("pinned", "false")),
            )
            assert samples[key] == 1
    assert samples[("lora_pin_adapters_registered", (("model", "qwen"),))] == 2
    with pytest.raises(ValueError, match=r"labels \{'model': 'llama'\} is already in this collector"):
        collector.add(two, labels={"model": "llama"})
    with pytest.raises(ValueError, match=r"label names: got \['team'\], this collector's are \['model'\]"):
        collector.add(two, labels={"team": "x"})
    with pytest.raises(ValueError, match="'tier' is a label lora_pin's metrics use"):
        LoRAMetricsCollector(one, labels={"tier": "x"})
