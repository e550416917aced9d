"""The adapter reader: files opened beneath the allowed roots by construction, read from the descriptor
they were checked on (symlink swaps, truncation, descriptors), pickled parameters."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_pin.errors import AdapterLoadError, LoraPinError, PathNotAllowedError
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama
from lora_pin.weights import HostAdapter, LoRATargets, load_adapter, open_adapter

WEIGHTS = "adapter_model.safetensors"
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Loads (and symlink swaps under them) the racing test runs at least.
RACING_LOADS = 1_000


@dataclass
class Adapters:
    targets: LoRATargets
    inside: Path  # an adapter inside the allowed root
    root: Path
    outside_weights: Path  # another adapter's weight file (same shapes), outside the root


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    from transformers import AutoModelForCausalLM

    base_dir = make_tiny_llama(tmp_path_factory.mktemp("base") / "llama", layers=2)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    inside = make_peft_adapter(base, root / "template", r=4, lora_alpha=8, target_modules=ATTN, seed=1)
    make_peft_adapter(base, outside / "other", r=4, lora_alpha=8, target_modules=ATTN, seed=2)
    return Adapters(LoRATargets.from_model(base), inside, root, outside / "other" / WEIGHTS)


def fresh_copy(adapters: Adapters, name: str) -> Path:
    copy = adapters.root / name
    shutil.copytree(adapters.inside, copy)
    return copy


def load(adapters: Adapters, path: Path, **kwargs: object) -> HostAdapter:
    return load_adapter(
        "swap",
        path,
        adapters.targets,
        max_rank=8,
        dtype=torch.float32,
        allowed_roots=[adapters.root],
        **kwargs,  # type: ignore[arg-type]
    )


def fingerprint(adapter: HostAdapter) -> list[torch.Tensor]:
    return [t for key in sorted(adapter.modules) for t in (adapter.modules[key].a, adapter.modules[key].b)]


def same_weights(a: HostAdapter, b: HostAdapter) -> bool:
    return all(torch.equal(x, y) for x, y in zip(fingerprint(a), fingerprint(b), strict=True))


def link_over(target: Path, path: Path) -> None:
    """Atomically replace ``path`` by a symlink to ``target`` (rename over it, as an attacker would)."""
    temporary = path.with_name(f".{path.name}.{threading.get_ident()}")
    temporary.symlink_to(target)
    os.replace(temporary, path)


def swap_after_resolving(
    monkeypatch: pytest.MonkeyPatch, ends_with: str, swap: Callable[[], None]
) -> list[str]:
    """Run ``swap`` right after the first ``os.path.realpath`` of a path ending in ``ends_with`` returns:
    the moment between a containment check and an open by name."""
    real_realpath, fired = os.path.realpath, list[str]()

    def resolve_then_swap(path: str | os.PathLike[str], *, strict: bool = False) -> str:
        result = real_realpath(os.fspath(path), strict=strict)
        if not fired and os.fspath(path).endswith(ends_with):
            fired.append(os.fspath(path))
            swap()
        return result

    monkeypatch.setattr(os.path, "realpath", resolve_then_swap)
    return fired


def test_a_symlink_swapped_over_the_weights_after_the_check_is_not_followed(
    adapters: Adapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whenever the reader resolves the weight file's path, the attacker renames a symlink out of the root
    # over it right after. Opened relative to the folder without following a symlink, there is no such
    # moment: the outside bytes are never read.
    reference = load(adapters, adapters.inside)
    path = fresh_copy(adapters, "swapped_after_check")
    swap_after_resolving(monkeypatch, WEIGHTS, lambda: link_over(adapters.outside_weights, path / WEIGHTS))
    try:
        loaded = load(adapters, path)
    except LoraPinError:
        return
    assert same_weights(loaded, reference), "the weights were read from outside the allowed root"


def test_a_weight_file_that_is_a_symlink_inside_the_root_loads(adapters: Adapters) -> None:
    # A download cache links snapshots/<rev>/<file> to blobs/<hash>, both under the root.
    path = fresh_copy(adapters, "linked_inside")
    blob = adapters.root / "blobs" / "abc123"
    blob.parent.mkdir(exist_ok=True)
    shutil.move(path / WEIGHTS, blob)
    (path / WEIGHTS).symlink_to(os.path.relpath(blob, path))
    assert same_weights(load(adapters, path), load(adapters, adapters.inside))


def test_a_link_inside_the_root_repointed_out_after_the_check_is_refused(
    adapters: Adapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fresh_copy(adapters, "repointed")
    blob = adapters.root / "blobs" / "repointed"
    blob.parent.mkdir(exist_ok=True)
    shutil.move(path / WEIGHTS, blob)
    (path / WEIGHTS).symlink_to(blob)
    # The link's target resolves inside; then the target itself becomes a symlink out of the root.
    fired = swap_after_resolving(monkeypatch, WEIGHTS, lambda: link_over(adapters.outside_weights, blob))
    with pytest.raises(PathNotAllowedError, match=r"'swap'.*changed while it was opened"):
        load(adapters, path)
    assert fired


def test_a_folder_swapped_for_a_symlink_out_after_the_check_is_refused(
    adapters: Adapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fresh_copy(adapters, "folder_swapped")
    elsewhere = adapters.outside_weights.parent

    def swap_folder() -> None:
        shutil.rmtree(path)
        path.symlink_to(elsewhere, target_is_directory=True)

    fired = swap_after_resolving(monkeypatch, "folder_swapped", swap_folder)
    with pytest.raises(PathNotAllowedError, match=r"'swap'.*changed while it was opened"):
        load(adapters, path)
    assert fired


def test_symlinks_swapped_continuously_never_escape(adapters: Adapters) -> None:
    # The adversarial run's race: a writer renames a symlink out of the root and a good copy over the
    # weight file, over and over, while loads run. Every load gives the inside weights or a LoraPinError.
    reference = load(adapters, adapters.inside)
    path = fresh_copy(adapters, "racing")
    good = adapters.root / "racing_good.safetensors"
    shutil.copy(path / WEIGHTS, good)
    stop = threading.Event()
    swaps = [0]

    def writer() -> None:
        while not stop.is_set():
            link_over(adapters.outside_weights, path / WEIGHTS)
            temporary = path / ".good"
            os.link(good, temporary)
            os.replace(temporary, path / WEIGHTS)
            swaps[0] += 1

    thread = threading.Thread(target=writer)
    thread.start()
    outcomes: dict[str, int] = {}
    try:
        # A count of loads and of swaps under them, not a span of time: as many on a busy machine.
        while (sum(outcomes.values()) < RACING_LOADS or swaps[0] < RACING_LOADS) and thread.is_alive():
            try:
                loaded = load(adapters, path)
            except LoraPinError as exc:
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                continue
            assert same_weights(loaded, reference), "the weights were read from outside the allowed root"
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
    finally:
        stop.set()
        thread.join()
    assert swaps[0] >= RACING_LOADS, "the writer stopped (see its thread's exception above)"


def test_a_file_truncated_while_read_is_refused(adapters: Adapters, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read with pread, not through a memory map: a truncation is a short read (refused), not SIGBUS.
    path = fresh_copy(adapters, "truncated_while_read")
    with open_adapter("swap", path, allowed_roots=[adapters.root]) as file:
        os.truncate(path / WEIGHTS, 100)
        pair = next(iter(file.pairs.values()))
        with pytest.raises(AdapterLoadError, match=r"'swap'.*changed while it was read"):
            file.tensor(pair.b_name)


def test_loading_leaves_no_descriptor_open(adapters: Adapters) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    path = fresh_copy(adapters, "descriptors")
    load(adapters, path)  # warm-up: imports and caches
    before = open_fds()
    for _ in range(5):
        load(adapters, path)
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterLoadError):
        load(adapters, path)
    assert open_fds() == before


def test_pickled_parameters_load_as_tensors(adapters: Adapters) -> None:
    # torch.save of a module's parameters gives nn.Parameter values (requires_grad): read as plain tensors.
    path = fresh_copy(adapters, "pickled_parameters")
    state = {k: torch.nn.Parameter(v) for k, v in load_file(path / WEIGHTS).items()}
    torch.save(state, path / "adapter_model.bin")
    (path / WEIGHTS).unlink()
    loaded = load(adapters, path, allow_pickle=True)
    assert same_weights(loaded, load(adapters, adapters.inside))
    assert not any(t.requires_grad for t in fingerprint(loaded))


@pytest.mark.parametrize("bad", ["\ud800", "a\0b"])
def test_a_path_that_cannot_name_a_file_is_an_adapter_load_error(adapters: Adapters, bad: str) -> None:
    with pytest.raises(AdapterLoadError, match=r"'swap': path .* cannot name a file"):
        load(adapters, adapters.root / bad)
