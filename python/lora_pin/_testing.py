"""Inputs for tests and benchmarks: adapter popularity patterns and random stacked pools for the ops, and a
slow adapter store (:func:`slow_store`) for background loading.

Private: for lora_pin's own tests and ``benches/`` (which run from the repository), not part of the API.

Punica's and S-LoRA's kernel evaluations use the same families: every request its own adapter
(``distinct``), adapters drawn uniformly (``uniform``), a power law (``zipf``), one adapter for all
(``identical``), and ``skewed``: one hot adapter holding most of the batch while every other slot
gets a single request (the most unbalanced segments; punica's own skewed case found a deadlock).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import torch

from lora_pin.ops.segments import KernelMeta
from lora_pin.weights.host_adapter import HostAdapter
from lora_pin.weights.host_tier import HostTier

__all__ = [
    "PATTERNS",
    "SlowStore",
    "StackedLayer",
    "random_layer",
    "request_slots",
    "slow_store",
    "wait_for",
]

_T = TypeVar("_T")

PATTERNS = ("distinct", "uniform", "zipf", "identical", "skewed")

_ZIPF_EXPONENT = 1.5


def request_slots(
    pattern: str,
    n_requests: int,
    n_slots: int,
    generator: torch.Generator | None = None,
    base_fraction: float = 0.0,
) -> torch.Tensor:
    """The device slot of each request in a batch: int64 ``[n_requests]``, ``-1`` for a base-model request.

    Args:
        pattern: one of :data:`PATTERNS`.
        n_requests: batch size in requests.
        n_slots: slots to draw from; ``distinct`` uses ``min(n_requests, n_slots)`` of them.
        generator: source of randomness, for reproducible batches.
        base_fraction: share of requests (rounded down) that use no adapter (slot ``-1``).

    Returns:
        The slots in a random order, so that a slot's requests are not adjacent in the batch.

    Raises:
        ValueError: unknown pattern, ``n_slots < 1``, or ``base_fraction`` outside ``[0, 1]``.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown popularity pattern {pattern!r}; expected one of {', '.join(PATTERNS)}")
    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
    if not 0.0 <= base_fraction <= 1.0:
        raise ValueError(f"base_fraction must be in [0, 1], got {base_fraction}")
    n = n_requests
    if pattern == "distinct":
        slots = torch.arange(n) % n_slots
    elif pattern == "uniform":
        slots = torch.randint(0, n_slots, (n,), generator=generator)
    elif pattern == "zipf":
        weights = 1.0 / torch.arange(1, n_slots + 1, dtype=torch.float64) ** _ZIPF_EXPONENT
        slots = torch.multinomial(weights, n, replacement=True, generator=generator) if n else torch.zeros(0)
    elif pattern == "identical":
        slots = torch.zeros(n, dtype=torch.int64)
    else:
        tail = min(n_slots - 1, n // 2)
        slots = torch.cat([torch.zeros(n - tail, dtype=torch.int64), torch.arange(1, tail + 1)])
    slots = slots.to(torch.int64)
    n_base = int(n * base_fraction)
    if n_base:
        slots[:n_base] = -1
    return slots[torch.randperm(n, generator=generator)]


class StackedLayer(NamedTuple):
    """One LoRA layer's device pool, in the layout the ops read."""

    a: torch.Tensor  # [slots, n_slices * R, in]
    b: torch.Tensor  # [slots, out_total, R]
    slot_ranks: torch.Tensor  # int32 [slots, n_slices]
    slot_scalings: torch.Tensor  # float32 [slots, n_slices]
    slice_offsets: list[int]  # n_slices + 1

    def meta(self, segments: KernelMeta) -> KernelMeta:
        """What the ops read to run ``segments`` through this layer."""
        return KernelMeta.for_layer(segments, self.slot_ranks, self.slot_scalings, self.slice_offsets)


def random_layer(
    n_slots: int,
    in_features: int,
    slice_widths: Sequence[int],
    ranks: Sequence[int | Sequence[int]],
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    max_rank: int | None = None,
    device: torch.device | str = "cpu",
) -> StackedLayer:
    """A stacked pool of random adapters whose outputs are O(1) for O(1) inputs.

    Args:
        n_slots: slots in the pool.
        in_features: the layer's input width.
        slice_widths: output width of each slice (``[out]`` for a plain layer, three for q/k/v).
        ranks: cycled over the slots; an int gives the slot that rank in every slice, a sequence one
            rank per slice (0: the slice is absent).
        dtype: of ``a`` and ``b``.
        generator: source of randomness.
        max_rank: the pool's padded rank ``R``; defaults to the largest rank given.
        device: where the tensors are put.

    Returns:
        A :class:`StackedLayer` whose rows and columns past each slot's rank are zero, as the device
        pool leaves them.
    """
    n_slices = len(slice_widths)
    per_slot = [[r] * n_slices if isinstance(r, int) else list(r) for r in ranks]
    slot_ranks = torch.tensor([per_slot[k % len(per_slot)] for k in range(n_slots)], dtype=torch.int32)
    pool_rank = int(slot_ranks.max()) if max_rank is None else max_rank
    offsets = [0]
    for width in slice_widths:
        offsets.append(offsets[-1] + width)
    a = torch.randn(n_slots, n_slices * pool_rank, in_features, generator=generator) / in_features**0.5
    b = torch.randn(n_slots, offsets[-1], pool_rank, generator=generator) / max(pool_rank, 1) ** 0.5
    for k in range(n_slots):
        for s in range(n_slices):
            rank = int(slot_ranks[k, s])
            a[k, s * pool_rank + rank : (s + 1) * pool_rank] = 0
            b[k, offsets[s] : offsets[s + 1], rank:] = 0
    scalings = torch.rand(n_slots, n_slices, generator=generator) + 0.5
    return StackedLayer(
        a.to(device=device, dtype=dtype),
        b.to(device=device, dtype=dtype),
        slot_ranks.to(device),
        scalings.to(device),
        offsets,
    )


# A gated read waits at most this long for its release, so a test that forgets one fails instead of hanging.
_GATE_TIMEOUT_S = 60.0


class SlowStore:
    """The adapter store :func:`slow_store` installs: every read waits ``delay_s`` seconds and, when
    ``gated``, until :meth:`release` lets its adapter through.

    Attributes:
        reads: ``(adapter name, thread name)`` of every read begun, in order.
    """

    def __init__(self, delay_s: float, gated: bool) -> None:
        self.delay_s = delay_s
        self.reads: list[tuple[str, str]] = []
        self._gated = gated
        self._released: set[str] = set()
        self._changed = threading.Condition()

    def release(self, *names: str) -> None:
        """Let the reads of ``names`` through, now and from now on; with no names, every read."""
        with self._changed:
            if names:
                self._released.update(names)
            else:
                self._gated = False
            self._changed.notify_all()

    def wait_for_read(self, name: str, timeout: float = _GATE_TIMEOUT_S) -> bool:
        """Block until a read of ``name`` has begun; False after ``timeout`` seconds (by default as long
        as a gated read waits for its release: a guard against a hang, far past a busy machine's delays)."""
        with self._changed:
            return self._changed.wait_for(lambda: any(n == name for n, _ in self.reads), timeout=timeout)

    def readers(self, name: str) -> list[str]:
        """The threads that began reading ``name``, in order."""
        with self._changed:
            return [thread for n, thread in self.reads if n == name]

    def _enter(self, name: str) -> None:
        with self._changed:
            self.reads.append((name, threading.current_thread().name))
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._gated or name in self._released, timeout=_GATE_TIMEOUT_S)
        if self.delay_s:
            time.sleep(self.delay_s)


@contextlib.contextmanager
def slow_store(delay_ms: float = 0.0, *, gated: bool = False) -> Iterator[SlowStore]:
    """Make every adapter read from disk (:meth:`lora_pin.weights.HostTier.read`, in every manager of the
    process) slow while the block runs: a stand-in for a slow disk or a network store.

    Each read first waits ``delay_ms`` milliseconds and, with ``gated``, until the store releases its
    adapter (:meth:`SlowStore.release`), so a test can hold a read in flight for as long as it needs.
    On exit every held read is let through and reads are fast again.

    Raises:
        ValueError: ``delay_ms`` is negative.
    """
    if not delay_ms >= 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
    store = SlowStore(delay_ms / 1e3, gated)
    original = HostTier.read

    def read(
        self: HostTier, name: str, path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
    ) -> HostAdapter:
        store._enter(name)
        return original(self, name, path, root=root)

    HostTier.read = read  # type: ignore[method-assign]
    try:
        yield store
    finally:
        HostTier.read = original  # type: ignore[method-assign]
        store.release()


class PeftOracle:
    """Greedy decoding of one prompt alone, through PEFT with an adapter folder or through the base
    model: the oracle the served outputs are checked against, token for token.

    Args:
        base_dir: the base model's folder (``transformers`` loads it; a PEFT model per adapter folder
            is built over a copy of it on first use and kept).
        eos: the token that ends a completion.
    """

    def __init__(self, base_dir: str | os.PathLike[str], eos: int) -> None:
        from transformers import AutoModelForCausalLM

        self.base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        self.eos = eos
        self._models: dict[str | None, torch.nn.Module] = {None: self.base}

    def tokens(
        self, prompt: list[int], adapter_dir: str | os.PathLike[str] | None, max_tokens: int
    ) -> list[int]:
        """The up to ``max_tokens`` token ids greedy decoding appends to ``prompt`` (ids), through the
        adapter at ``adapter_dir`` (None: the base model), stopping after :attr:`eos`."""
        model = self._model(adapter_dir)
        out: list[int] = []
        inputs, past = torch.tensor([prompt]), None
        with torch.no_grad():
            for _ in range(max_tokens):
                result = model(inputs, cache=past, use_cache=True)
                token = int(result.logits[0, -1].argmax())
                out.append(token)
                if token == self.eos:
                    break
                inputs, past = torch.tensor([[token]]), result.cache
        return out

    def log_softmax(
        self, prompt: list[int], adapter_dir: str | os.PathLike[str] | None, generated: list[int]
    ) -> torch.Tensor:
        """float64 ``[len(generated), vocab]``: ``log_softmax`` of the logits predicting each token of
        ``generated`` after ``prompt`` (one forward over both), through the adapter at ``adapter_dir``."""
        model = self._model(adapter_dir)
        ids = torch.tensor([prompt + generated[:-1]]) if generated else torch.tensor([prompt])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 :].double()
        return torch.log_softmax(logits, dim=-1)[: len(generated)]

    def _model(self, adapter_dir: str | os.PathLike[str] | None) -> torch.nn.Module:
        import copy

        from peft import PeftModel

        key = None if adapter_dir is None else str(adapter_dir)
        if key not in self._models:
            assert key is not None  # the base model is always there
            self._models[key] = PeftModel.from_pretrained(copy.deepcopy(self.base), key).eval()
        return self._models[key]


def wait_for(what: str, check: Callable[[], _T | None], patience: float, every: float = 0.2) -> _T:
    """Polls ``check()`` every ``every`` s until it returns something other than None (or False), and
    returns it; fails (AssertionError) naming ``what`` when ``patience`` seconds pass first. The tests
    that drive servers decide from what the servers report, polled this way, never from a sleep."""
    deadline = time.monotonic() + patience
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {patience:g} s"
        time.sleep(every)
