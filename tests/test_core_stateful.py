"""Hypothesis drives the Rust registry and a plain-Python model of the same rules
(``benches/plan_step.py``'s ``PythonPlanner``, dicts and OrderedDicts scanned in policy order) with the
same random operations; every result, every plan array, every error class and the per-tier counters
must agree, and the registry's own invariant audit must pass after every step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lora_pin._core import LoRARef, LoRARegistry
from lora_pin.errors import LoraPinError

_spec = importlib.util.spec_from_file_location(
    "plan_step", Path(__file__).resolve().parents[1] / "benches" / "plan_step.py"
)
assert _spec is not None and _spec.loader is not None
plan_step = importlib.util.module_from_spec(_spec)
sys.modules["plan_step"] = plan_step
_spec.loader.exec_module(plan_step)
PythonPlanner = plan_step.PythonPlanner

NAMES = [f"n{i}" for i in range(7)]
names = st.sampled_from(NAMES)


def ints(buf: bytearray) -> list[int]:
    return torch.frombuffer(buf, dtype=torch.int32).tolist() if buf else []


def same_outcome(rust: Any, model: Any) -> Any:
    """Runs both calls; both must return equal values or raise the same lora_pin error class."""
    try:
        expected = model()
    except LoraPinError as e:
        with pytest.raises(type(e)):
            rust()
        return None
    return expected, rust()


class RegistryVsModel(RuleBasedStateMachine):
    reg: LoRARegistry
    model: Any

    @initialize(
        slots=st.integers(1, 3),
        extra=st.none() | st.integers(0, 3),
        max_bytes=st.none() | st.integers(300, 1200),
        policy=st.sampled_from(["lru", "fifo"]),
        host_policy=st.sampled_from(["lru", "fifo"]),
        chunk=st.none() | st.integers(1, 3),
    )
    def start(
        self,
        slots: int,
        extra: int | None,
        max_bytes: int | None,
        policy: str,
        host_policy: str,
        chunk: int | None,
    ) -> None:
        loaded = None if extra is None else slots + extra
        kw: dict[str, Any] = {"max_host_bytes": max_bytes, "chunk_size": chunk}
        self.reg = LoRARegistry(slots, loaded, eviction_policy=policy, host_eviction_policy=host_policy, **kw)
        self.model = PythonPlanner(slots, loaded, policy=policy, host_policy=host_policy, **kw)
        self.ids: dict[str, list[str]] = {}

    @rule(name=names, pinned=st.booleans(), nbytes=st.integers(1, 400), rank=st.integers(1, 16))
    def register(self, name: str, pinned: bool, nbytes: int, rank: int) -> None:
        ref = LoRARef(name, f"/srv/{name}", pinned=pinned)
        got = same_outcome(
            lambda: self.reg.register(ref, rank=rank, host_bytes=nbytes, device_bytes=nbytes),
            lambda: self.model.register(ref, rank=rank, host_bytes=nbytes),
        )
        if got:
            assert got[0] == got[1]

    @rule(nbytes=st.integers(1, 150))
    def register_every_name(self, nbytes: int) -> None:
        """More adapters than slots, so steps contend for slots and victims must be chosen."""
        for name in NAMES:
            self.register(name, False, nbytes, 8)

    @rule(name=names)
    def pin(self, name: str) -> None:
        same_outcome(lambda: self.reg.pin(name), lambda: self.model.pin(name))

    @rule(name=names)
    def unpin(self, name: str) -> None:
        same_outcome(lambda: self.reg.unpin(name), lambda: self.model.unpin(name))

    @rule(name=names)
    def acquire(self, name: str) -> None:
        got = same_outcome(lambda: self.reg.acquire([name, None]), lambda: self.model.acquire([name, None]))
        if got:
            assert got[0] == got[1]
            self.ids.setdefault(name, []).append(got[0][0])

    @precondition(lambda self: any(self.ids.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, ids in self.ids.items() if ids)))
        lora_id = self.ids[name].pop()
        same_outcome(lambda: self.reg.release([lora_id]), lambda: self.model.release([lora_id]))

    @rule(name=names)
    def over_release(self, name: str) -> None:
        lora_id = LoRARef(name, f"/srv/{name}").lora_id
        ids = [lora_id] * (len(self.ids.get(name, [])) + 1)
        same_outcome(lambda: self.reg.release(ids), lambda: self.model.release(ids))

    @rule(name=names)
    def unload(self, name: str) -> None:
        got = same_outcome(lambda: self.reg.try_unload(name), lambda: self.model.try_unload(name))
        if got:
            assert got[0] == got[1]
            if got[0]:
                self.ids.pop(name, None)

    @rule(
        requests=st.lists(st.tuples(st.none() | names, st.integers(0, 3)), max_size=10),
        loaded=st.integers(0, 3),
    )
    def plan(self, requests: list[tuple[str | None, int]], loaded: int) -> None:
        """Plans a step; unless `loaded` is 0, reports its loads done as a serving loop would."""
        batch = [n for n, _ in requests]
        tokens = [t for _, t in requests]
        got = same_outcome(lambda: self.reg.plan(batch, tokens), lambda: self.model.plan(batch, tokens))
        if not got:
            return
        expected, plan = got
        assert plan.admitted == expected.admitted
        assert plan.deferred == expected.deferred
        assert ints(plan.request_slots) == expected.request_slots
        assert ints(plan.token_slots) == expected.token_slots
        assert ints(plan.token_perm) == expected.token_perm
        assert ints(plan.seg_indptr) == expected.seg_indptr
        assert ints(plan.seg_slots) == expected.seg_slots
        assert plan.loads == expected.loads
        assert plan.evictions == expected.evictions
        assert ints(plan.slot_ranks) == self.model.slot_ranks()
        assert torch.frombuffer(plan.slot_generations, dtype=torch.int64).tolist() == self.model.generations
        if loaded:
            for name, *_ in plan.loads:
                self.reg.load_done(name)
                self.model.load_done(name)

    @rule(name=names, ok=st.booleans())
    def finish_load(self, name: str, ok: bool) -> None:
        if ok:
            same_outcome(lambda: self.reg.load_done(name), lambda: self.model.load_done(name))
        else:
            same_outcome(lambda: self.reg.load_failed(name), lambda: self.model.load_failed(name))

    @rule()
    def end_step(self) -> None:
        self.reg.end_step()
        self.model.end_step()

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "reg"):
            return
        self.reg.audit()
        stats = self.reg.stats()
        for tier, expected in self.model.stats().items():
            assert {k: stats[tier][k] for k in expected} == expected, tier


TestRegistryVsModel = RegistryVsModel.TestCase
TestRegistryVsModel.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
