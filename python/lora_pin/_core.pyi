from collections.abc import Callable, Iterable, Mapping, Sequence
from os import PathLike
from typing import Any, Literal, TypeAlias, final

__all__ = [
    "EVICTION_POLICIES",
    "MAX_ADAPTER_RANK",
    "MAX_ARRIVAL_CV",
    "MAX_SLOTS",
    "MIN_ARRIVAL_CV",
    "OVERDUE_AFTER",
    "CpuPageTable",
    "CpuSgmvPlan",
    "FetchPlan",
    "LoRARef",
    "LoRARegistry",
    "PatternSet",
    "StepPlan",
    "Trace",
    "__version__",
    "_checked_names",
    "_index_header",
    "_lora_pairs",
    "_read_tensors",
    "_unload_timeout_error",
    "admit_rotating",
    "admit_waiting",
    "check_limits",
    "cpu_features",
    "dora_scale_rows",
    "home_replicas",
    "parse_lora_paths",
    "rank_replicas",
    "ranks_by_name",
    "replication_factor",
    "sgmv_cpu_available",
    "simulate",
    "simulate_replicas",
]
__version__: str
MAX_SLOTS: int
MAX_ADAPTER_RANK: int
OVERDUE_AFTER: int
MIN_ARRIVAL_CV: float
MAX_ARRIVAL_CV: float
EVICTION_POLICIES: tuple[str, ...]

@final
class LoRARef:
    def __new__(
        cls,
        lora_name: str,
        lora_path: str,
        *,
        pinned: bool = False,
        base_model_name: str | None = None,
        lora_id: str | None = None,
    ) -> LoRARef: ...
    @staticmethod
    def new(lora_name: str, lora_path: str, pinned: bool = False) -> LoRARef: ...
    @property
    def lora_id(self) -> str: ...
    @property
    def lora_name(self) -> str: ...
    @property
    def lora_path(self) -> str: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def base_model_name(self) -> str | None: ...
    def to_dict(self) -> dict[str, Any]: ...
    def to_spec(self) -> str: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

_SpecValue: TypeAlias = str | Mapping[str, str | bool | PathLike[str] | None] | LoRARef
# How a step brings in adapters outside the host tier (``LoRARegistry.begin_step``'s ``mode``).
_StepMode: TypeAlias = Literal["read_in_step", "read_first", "fetch"]
# What ``begin_step`` did: the caller's next move (``StepPlan.action``).
_StepAction: TypeAlias = Literal["begun", "discover", "read_first", "fetching"]

def parse_lora_paths(
    values: Mapping[str, str] | Iterable[_SpecValue] | None,
    *,
    max_loras_per_batch: int | None = None,
    max_loaded_loras: int | None = None,
) -> list[LoRARef]: ...
def check_limits(
    num_adapters: int,
    num_pinned: int,
    *,
    max_loras_per_batch: int | None = None,
    max_loaded_loras: int | None = None,
) -> None: ...

@final
class StepPlan:
    @property
    def admitted(self) -> list[int]: ...
    @property
    def deferred(self) -> list[int]: ...
    @property
    def request_slots(self) -> bytearray: ...
    @property
    def token_slots(self) -> bytearray: ...
    @property
    def token_perm(self) -> bytearray: ...
    @property
    def seg_indptr(self) -> bytearray: ...
    @property
    def seg_slots(self) -> bytearray: ...
    @property
    def slot_ranks(self) -> bytearray: ...
    @property
    def slot_scalings(self) -> bytearray: ...
    @property
    def slot_epochs(self) -> bytearray: ...
    @property
    def page_indptr(self) -> bytearray: ...
    @property
    def page_table(self) -> bytearray: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def loads(self) -> list[tuple[str, str, int, str]]: ...
    @property
    def action(self) -> _StepAction: ...
    @property
    def ticket(self) -> int | None: ...
    @property
    def to_read(self) -> list[str]: ...
    @property
    def unknown(self) -> list[str]: ...
    @property
    def progress(self) -> bool: ...
    @property
    def reasons(self) -> list[str]: ...
    @property
    def failed(self) -> list[tuple[int, str]]: ...
    @property
    def slots_used(self) -> bytes: ...
    def outcome(
        self,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...], list[tuple[int, str]], int]: ...
    def step_arrays(self) -> tuple[bytearray, tuple[int, int, int, int]]: ...
    def startable(self, waiting: Sequence[bool], order: str = "arrival") -> list[int]: ...
    def subset(
        self, requests: Sequence[int], num_tokens: Sequence[int]
    ) -> tuple[bytearray, tuple[int, int, int, int]]: ...
    @property
    def evictions(self) -> list[tuple[str, str, int]]: ...
    @property
    def to_fetch(self) -> list[tuple[str, int]]: ...

@final
class FetchPlan:
    @property
    def to_fetch(self) -> list[tuple[str, int]]: ...
    @property
    def skipped(self) -> list[str]: ...

@final
class LoRARegistry:
    def __new__(
        cls,
        max_loras_per_batch: int | None,
        max_loaded_loras: int | None = None,
        *,
        max_host_bytes: int | None = None,
        eviction_policy: str = "lru",
        host_eviction_policy: str = "lru",
        chunk_size: int | None = None,
        page_rank: int | None = None,
        max_lora_memory: int | None = None,
    ) -> LoRARegistry: ...
    @property
    def max_loras_per_batch(self) -> int: ...
    @property
    def page_rank(self) -> int | None: ...
    @property
    def max_lora_memory(self) -> int | None: ...
    @property
    def max_loaded_loras(self) -> int | None: ...
    @property
    def chunk_size(self) -> int | None: ...
    def register(
        self, lora_ref: LoRARef, *, rank: int, host_bytes: int, device_bytes: int, scaling: float = 1.0
    ) -> list[str]: ...
    def pin(self, name: str) -> None: ...
    def unpin(self, name: str) -> None: ...
    def unload(self, name: str, timeout: float | None = None) -> None: ...
    def try_unload(self, name: str) -> bool: ...
    def begin_unload(self, name: str) -> int | None: ...
    def finish_unload(self, handle: int) -> int: ...
    def begin_step(
        self,
        names: Iterable[str | None],
        num_tokens: int | Iterable[int],
        mode: _StepMode = "read_in_step",
        *,
        whole: bool = False,
        failed: Sequence[str] = ...,
        discovering: Sequence[str] = ...,
        discover: bool = False,
    ) -> StepPlan: ...
    def prefetch(self, names: Sequence[str | None]) -> FetchPlan: ...
    def fetch_done(self, name: str, serial: int) -> list[str]: ...
    def fetch_failed(self, name: str, serial: int) -> None: ...
    def enter_host_tier(self, name: str, serial: int) -> list[str]: ...
    def report_load(self, ticket: int, index: int, ok: bool) -> None: ...
    def finish_step(self, ticket: int) -> None: ...
    def offer_order(
        self,
        names: Sequence[str | None],
        overtaken: Sequence[int | None],
        remaining: Sequence[int | None] | None = None,
        order: str = "arrival",
    ) -> list[int]: ...
    def split(self, names: Iterable[str | None]) -> list[list[int]]: ...
    def overflow(self, names: Iterable[str | None]) -> str | None: ...
    def invalidate_slots(self, slots: Sequence[int]) -> None: ...
    def replace(
        self, name: str, serial: int, *, rank: int, host_bytes: int, device_bytes: int, scaling: float = 1.0
    ) -> list[str]: ...
    def placement(self) -> dict[str, Any]: ...
    def serial(self, name: str) -> int: ...
    def lora_ref(self, name: str) -> LoRARef: ...
    def in_flight(self, name: str) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def audit(self) -> None: ...
    def __contains__(self, name: str, /) -> bool: ...
    def __len__(self) -> int: ...

def _read_tensors(
    fd: int, reads: Sequence[tuple[str, str, Sequence[int], int, int, int]], *, threads: int = 1
) -> tuple[bytes, list[int | None]]: ...
def _index_header(
    json: bytes, data_start: int, file_size: int, max_tensors: int
) -> tuple[
    int, list[tuple[str, str, list[int], int, int]], list[tuple[str, int, int, bool, int | None]], list[int]
]: ...
def _lora_pairs(
    tensors: Sequence[tuple[str, Sequence[int]]],
) -> tuple[list[tuple[str, int, int, bool, int | None]], list[int]]: ...
def _checked_names(names: Iterable[str | None]) -> list[str | None]: ...
def _unload_timeout_error(name: str, in_flight: int, waited: float) -> BaseException: ...

@final
class Trace:
    @staticmethod
    def generate(workload: str, *, adapters: int, requests: int, seed: int = 0) -> Trace: ...
    @staticmethod
    def from_jsonl(text: str, source: str = "<trace>") -> Trace: ...
    @staticmethod
    def from_file(path: str) -> Trace: ...
    @property
    def names(self) -> list[str]: ...
    def with_gamma_arrivals(self, rate: float, *, cv: float = 1.0, seed: int = 0) -> Trace: ...
    def most_requested(self, k: int) -> list[str]: ...
    def requests(self) -> list[tuple[str | None, int, float | None]]: ...
    def __len__(self) -> int: ...

def simulate(
    trace: Trace,
    *,
    slots: int,
    max_loaded_loras: int | None = None,
    policy: str = "lru",
    pins: Sequence[str] = ...,
    batch_size: int = 4,
    step_seconds: float = 0.02,
    adapter_bytes: int = 33554432,
    load_ms: float = 0.0,
    record: bool = False,
    progress: Callable[[int], object] | None = None,
    ranks: Sequence[tuple[int, float]] = ...,
    max_host_bytes: int | None = None,
    page_rank: int | None = None,
    max_lora_memory: int | None = None,
    decode: bool = False,
    order: str = "arrival",
) -> dict[str, Any]: ...
def ranks_by_name(names: Sequence[str], ranks: Sequence[tuple[int, float]]) -> list[int]: ...
def rank_replicas(
    adapter: str | None,
    replicas: Sequence[tuple[str, str, int, int, int]],
    *,
    pinned: bool = False,
    homes: int = 1,
) -> list[int]: ...
def admit_waiting(
    adapters: Sequence[int | None],
    waited: Sequence[int],
    *,
    running: Sequence[int],
    pinned: Sequence[int],
    slots: int,
    age_bound: int,
) -> tuple[list[int], list[int]]: ...
def admit_rotating(
    adapters: Sequence[int | None],
    waited: Sequence[int],
    running: Sequence[bool],
    *,
    pinned: Sequence[int],
    slots: int,
    age_bound: int,
) -> tuple[list[int], list[int], list[int]]: ...
def replication_factor(share: float, replicas: int) -> int: ...
def home_replicas(adapter: str, replicas: Sequence[str], homes: int) -> list[int]: ...
def simulate_replicas(
    trace: Trace,
    *,
    replicas: int,
    router: str,
    slots: int,
    max_loaded_loras: int | None = None,
    policy: str = "lru",
    pins: Sequence[str] = ...,
    batch_size: int = 4,
    step_seconds: float = 0.02,
    adapter_bytes: int = 33554432,
    queue_bound: int = 16,
    seed: int = 0,
    ranks: Sequence[tuple[int, float]] = ...,
    max_host_bytes: int | None = None,
) -> dict[str, Any]: ...
def sgmv_cpu_available() -> bool: ...
def cpu_features() -> dict[str, bool]: ...
def dora_scale_rows(
    out: tuple[int, int],
    width: int,
    bias: tuple[int, int] | None,
    factors: tuple[int, int],
    rows: tuple[int, int],
    slots: tuple[int, int],
) -> None: ...

@final
class CpuSgmvPlan:
    def __new__(
        cls,
        n_tokens: int,
        tokens: Sequence[int],
        group_indptr: Sequence[int],
        group_slots: Sequence[int],
        ranks: Sequence[int],
        *,
        n_slices: int,
        max_rank: int,
    ) -> CpuSgmvPlan: ...
    @property
    def n_rows(self) -> int: ...
    def shrink(
        self,
        dtype: str,
        x: tuple[int, int],
        in_features: int,
        a: tuple[int, int],
        v: tuple[int, int],
        *,
        threads: int = 1,
    ) -> None: ...
    def expand(
        self,
        dtype: str,
        out: tuple[int, int],
        v: tuple[int, int],
        b: tuple[int, int],
        scalings: tuple[int, int],
        slice_offsets: Sequence[int],
        *,
        threads: int = 1,
    ) -> None: ...
    def lora_delta(
        self,
        dtype: str,
        out: tuple[int, int],
        x: tuple[int, int],
        in_features: int,
        a: tuple[int, int],
        b: tuple[int, int],
        scalings: tuple[int, int],
        slice_offsets: Sequence[int],
        *,
        threads: int = 1,
    ) -> None: ...
    def paged_shrink(
        self,
        dtype: str,
        x: tuple[int, int],
        in_features: int,
        a_pages: tuple[int, int],
        pages: CpuPageTable,
        v: tuple[int, int],
        *,
        threads: int = 1,
    ) -> None: ...
    def paged_expand(
        self,
        dtype: str,
        out: tuple[int, int],
        v: tuple[int, int],
        b_pages: tuple[int, int],
        pages: CpuPageTable,
        scalings: tuple[int, int],
        slice_offsets: Sequence[int],
        *,
        threads: int = 1,
    ) -> None: ...
    def paged_lora_delta(
        self,
        dtype: str,
        out: tuple[int, int],
        x: tuple[int, int],
        in_features: int,
        a_pages: tuple[int, int],
        b_pages: tuple[int, int],
        pages: CpuPageTable,
        scalings: tuple[int, int],
        slice_offsets: Sequence[int],
        *,
        threads: int = 1,
    ) -> None: ...

@final
class CpuPageTable:
    def __new__(
        cls,
        page_indptr: Sequence[int],
        page_table: Sequence[int],
        *,
        page_rank: int,
        num_pages: int,
    ) -> CpuPageTable: ...
    @property
    def page_rank(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def n_slots(self) -> int: ...

@final
class PatternSet:
    def __new__(
        cls,
        patterns: Sequence[str],
        *,
        anchoring: Literal["start", "full", "dotted_suffix"],
        context: str = "",
        labels: Sequence[str] | None = None,
    ) -> PatternSet: ...
    @property
    def patterns(self) -> list[str]: ...
    @property
    def anchoring(self) -> str: ...
    def __len__(self) -> int: ...
    def first_match(self, key: str) -> int | None: ...
    def first_matches(self, keys: Sequence[str]) -> list[int | None]: ...
    def used_by(self, keys: Sequence[str]) -> list[bool]: ...
    def group(self, key: str, name: str) -> str | None: ...
