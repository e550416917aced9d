"""A corpus of broken adapters, generated here, loaded into a serving :class:`LoRAManager`.

Each case copies a good PEFT adapter and breaks one thing. Loading it must raise an ``AdapterLoadError``
(or a subclass) whose message names the adapter and the problem, and must change nothing: the registry's
stats, the host tier (names and bytes), every device pool buffer, and the logits of a fixed mixed batch
over the other adapters stay bit-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_pin import AdapterLoadError, LoRAManager, PathNotAllowedError, UnsafeFormatError
from lora_pin.fixtures import make_peft_adapter
from lora_pin.weights.reader import AdapterFile

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
BATCH: list[str | None] = ["good_a", None, "good_b", "good_a", None, "good_c"]


@dataclass
class Served:
    root: Path
    outside: Path
    good: Path
    mgr: LoRAManager
    model: torch.nn.Module
    ids: torch.Tensor
    logits: torch.Tensor


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, tiny_llama: torch.nn.Module
) -> Served:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    base_dir, maker = tiny_llama_dir, tiny_llama
    good = make_peft_adapter(maker, root / "template", r=4, lora_alpha=8, target_modules=ATTN, seed=1)
    paths = {
        "good_a": make_peft_adapter(maker, root / "a", r=4, lora_alpha=8, target_modules=ATTN, seed=2),
        "good_b": make_peft_adapter(maker, root / "b", r=8, lora_alpha=4, target_modules=ATTN, seed=3),
        "good_c": make_peft_adapter(
            maker, root / "c", r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"], seed=4
        ),
    }
    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    mgr = LoRAManager(
        model,
        [f"{n}={p}" for n, p in paths.items()],
        max_loras_per_batch=3,
        max_lora_rank=8,
        allowed_roots=[root],
    )
    ids = torch.randint(0, 128, (len(BATCH), 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), mgr.batch(BATCH):
        logits = model(ids).logits
    return Served(root, outside, good, mgr, model, ids, logits)


def snapshot(mgr: LoRAManager) -> dict[str, Any]:
    """Everything a refused load must leave alone (the logits are checked separately)."""
    pool = {}
    for group in mgr.targets.groups:
        a, b, ranks, scalings, _ = mgr.pool.buffers(group.key)
        pool[group.key] = tuple(t.clone() for t in (a, b, ranks, scalings))
    return {
        "stats": mgr.registry.stats(),
        "host": {n: mgr.host[n].nbytes for n in mgr.host},
        "occupants": [mgr.pool.occupant(s) for s in range(mgr.pool.slots)],
        "pool": pool,
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["stats"] == after["stats"]
    assert before["host"] == after["host"]
    assert before["occupants"] == after["occupants"]
    for key, tensors in before["pool"].items():
        for old, new in zip(tensors, after["pool"][key], strict=True):
            assert torch.equal(old, new), f"pool buffers of {key} changed"


# ---- the corpus: each case breaks a fresh copy of the good adapter ---------------------------------------


def _config(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / CONFIG).read_text())
    return data


def _edit_config(**changes: Any) -> Callable[[Path, Served], Path]:
    def edit(path: Path, _: Served) -> Path:
        data = _config(path)
        data.update(changes)
        (path / CONFIG).write_text(json.dumps(data))
        return path

    return edit


def _edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path, Served], Path]:
    def edit(path: Path, _: Served) -> Path:
        tensors = load_file(path / WEIGHTS)
        change(tensors)
        save_file(tensors, path / WEIGHTS)
        return path

    return edit


def _first(tensors: dict[str, torch.Tensor], half: str) -> str:
    return sorted(k for k in tensors if f".lora_{half}." in k)[0]


def _set_value(value: float, dtype: torch.dtype = torch.float32) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            tensors[key] = tensors[key].to(dtype)
        tensors[_first(tensors, "B")].view(-1)[3] = value

    return change


def _rank_16(path: Path, served: Served) -> Path:
    _edit_tensors(
        lambda t: t.update(
            {
                k: torch.ones(16, v.shape[1]) if ".lora_A." in k else torch.ones(v.shape[0], 16)
                for k, v in t.items()
            }
        )
    )(path, served)
    return _edit_config(r=16)(path, served)


def _truncate(path: Path, _: Served) -> Path:
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[: len(data) // 2])
    return path


def _header_length(delta: int) -> Callable[[Path, Served], Path]:
    def edit(path: Path, _: Served) -> Path:
        data = bytearray((path / WEIGHTS).read_bytes())
        (length,) = struct.unpack("<Q", data[:8])
        data[:8] = struct.pack("<Q", max(length + delta, 0) if delta > -(1 << 62) else 1 << 62)
        (path / WEIGHTS).write_bytes(bytes(data))
        return path

    return edit


def _header_offsets(path: Path, _: Served) -> Path:
    data = (path / WEIGHTS).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["data_offsets"][1] += 10**9  # a span far past the end of the file
    raw = json.dumps(header).encode()
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    return path


def _many_tensors(path: Path, _: Served) -> Path:
    header = {f"t{i}": {"dtype": "F32", "shape": [0, 0], "data_offsets": [0, 0]} for i in range(70_000)}
    raw = json.dumps(header).encode()
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def _huge_sparse(path: Path, _: Served) -> Path:
    with open(path / WEIGHTS, "r+b") as handle:
        handle.truncate(17 << 30)  # sparse: no disk is used, only the size lies
    return path


def _huge_config(path: Path, _: Served) -> Path:
    text = json.dumps(_config(path))
    (path / CONFIG).write_text(text[:-1] + " " * (2 << 20) + "}")
    return path


def _write(name: str, content: bytes) -> Callable[[Path, Served], Path]:
    def edit(path: Path, _: Served) -> Path:
        (path / name).write_bytes(content)
        return path

    return edit


def _remove(name: str) -> Callable[[Path, Served], Path]:
    def edit(path: Path, _: Served) -> Path:
        (path / name).unlink()
        return path

    return edit


def _replace_by_directory(name: str) -> Callable[[Path, Served], Path]:
    # Tests run as root, where chmod 000 does not stop a read; a directory in the file's place makes the
    # read itself fail (EISDIR), the same OSError path an unreadable file takes.
    def edit(path: Path, _: Served) -> Path:
        (path / name).unlink()
        (path / name).mkdir()
        return path

    return edit


def _replace_by_fifo(name: str) -> Callable[[Path, Served], Path]:
    # Opening a FIFO for reading blocks until a writer comes: the load must refuse it, not hang.
    def edit(path: Path, _: Served) -> Path:
        (path / name).unlink()
        os.mkfifo(path / name)
        return path

    return edit


def _unprefixed_twin(path: Path, _: Served) -> Path:
    # A second lora_A for a module under the bare name (no "base_model.model."): PEFT ignores it.
    tensors = load_file(path / WEIGHTS)
    first = _first(tensors, "A")
    tensors[first.removeprefix("base_model.model.")] = torch.ones_like(tensors[first])
    save_file(tensors, path / WEIGHTS)
    return path


def _pickle_only(path: Path, _: Served) -> Path:
    torch.save(load_file(path / WEIGHTS), path / "adapter_model.bin")
    (path / WEIGHTS).unlink()
    return path


def _a_file(path: Path, _: Served) -> Path:
    return path / CONFIG


def _dot_dot(path: Path, served: Served) -> Path:
    return served.root / "template" / ".." / path.name


def _symlinked_dir(path: Path, served: Served) -> Path:
    target = served.outside / path.name
    shutil.move(path, target)
    path.symlink_to(target, target_is_directory=True)
    return path


def _symlinked_weights(path: Path, served: Served) -> Path:
    target = served.outside / f"{path.name}.safetensors"
    shutil.move(path / WEIGHTS, target)
    (path / WEIGHTS).symlink_to(target)
    return path


def _absolute_outside(path: Path, served: Served) -> Path:
    target = served.outside / path.name
    shutil.copytree(path, target)
    return target


# name -> (how to break the copy, the error class, a regex the message must match)
CASES: dict[str, tuple[Callable[[Path, Served], Path], type[Exception], str]] = {
    "truncated_safetensors": (_truncate, AdapterLoadError, "cannot read safetensors"),
    "header_length_too_big": (_header_length(1 << 40), AdapterLoadError, "cannot read safetensors"),
    "header_length_too_small": (_header_length(-7), AdapterLoadError, "cannot read safetensors"),
    "header_offsets_past_end": (_header_offsets, AdapterLoadError, "cannot read safetensors"),
    "not_safetensors_at_all": (_write(WEIGHTS, b"\x00" * 5), AdapterLoadError, "cannot read safetensors"),
    "integer_dtype": (_edit_tensors(_set_value(1, torch.int32)), AdapterLoadError, "non-float dtype"),
    "mixed_dtypes": (
        _edit_tensors(lambda t: t.update({_first(t, "A"): t[_first(t, "A")].half()})),
        AdapterLoadError,
        "mixed dtypes",
    ),
    "nan_weight": (_edit_tensors(_set_value(float("nan"))), AdapterLoadError, r"lora_B.*NaN/Inf"),
    "inf_weight": (_edit_tensors(_set_value(float("-inf"))), AdapterLoadError, r"lora_B.*NaN/Inf"),
    "overflows_serving_dtype": (
        _edit_tensors(_set_value(1e300, torch.float64)),
        AdapterLoadError,
        r"NaN/Inf.*stored as torch.float64",
    ),
    "shape_does_not_fit": (
        _edit_tensors(lambda t: t.update({_first(t, "A"): torch.zeros(4, 63)})),
        AdapterLoadError,
        "do not fit module",
    ),
    "three_dimensional": (
        _edit_tensors(lambda t: t.update({_first(t, "A"): torch.zeros(4, 64, 1)})),
        AdapterLoadError,
        "expected 2-D",
    ),
    "rank_differs_from_config": (_edit_config(r=2), AdapterLoadError, "has rank 4 but field 'r'"),
    "rank_above_pool": (_rank_16, AdapterLoadError, "rank 16, above the pool's max rank 8"),
    "missing_config": (_remove(CONFIG), AdapterLoadError, "does not exist"),
    "config_not_json": (_write(CONFIG, b"{r: 4,"), AdapterLoadError, "not valid JSON"),
    "config_a_list": (_write(CONFIG, b"[1, 2]"), AdapterLoadError, "expected a JSON object"),
    "config_too_large": (_huge_config, AdapterLoadError, "MAX_CONFIG_BYTES"),
    "r_zero": (_edit_config(r=0), AdapterLoadError, "field 'r' must be a positive integer"),
    "r_absurd": (_edit_config(r=10**9), AdapterLoadError, "MAX_ADAPTER_RANK"),
    "alpha_negative": (_edit_config(lora_alpha=-8), AdapterLoadError, "'lora_alpha' must be a positive"),
    "alpha_null": (_edit_config(lora_alpha=None), AdapterLoadError, "'lora_alpha' must be a positive"),
    "alpha_string": (_edit_config(lora_alpha="8"), AdapterLoadError, "'lora_alpha' must be a positive"),
    "target_regex_matches_nothing": (
        _edit_config(target_modules=r".*\.nothing_proj"),
        AdapterLoadError,
        "target_modules/layers_to_transform exclude",
    ),
    "target_list_names_absent_module": (
        _edit_config(target_modules=[*ATTN, "lm_head_proj"]),
        AdapterLoadError,
        "'lm_head_proj', which is not a LoRA target",
    ),
    "rank_pattern_names_absent_module": (
        _edit_config(rank_pattern={"down_proj": 16}),
        AdapterLoadError,
        "'rank_pattern' key 'down_proj' matches no module",
    ),
    "alpha_pattern_names_absent_module": (
        _edit_config(alpha_pattern={"q_prj": 3}),
        AdapterLoadError,
        "'alpha_pattern' key 'q_prj' matches no module",
    ),
    "dora": (_edit_config(use_dora=True), AdapterLoadError, "DoRA"),
    "unused_tensor": (
        _edit_tensors(lambda t: t.update({"base_model.model.extra.weight": torch.zeros(2, 2)})),
        AdapterLoadError,
        "would be unused",
    ),
    "lora_b_missing": (
        _edit_tensors(lambda t: t.pop(_first(t, "B"))),
        AdapterLoadError,
        "would be unused",
    ),
    "no_weights": (_remove(WEIGHTS), AdapterLoadError, "no adapter_model.safetensors"),
    "weights_fifo": (_replace_by_fifo(WEIGHTS), AdapterLoadError, "not a regular file"),
    "config_fifo": (_replace_by_fifo(CONFIG), AdapterLoadError, "not a regular file"),
    "unprefixed_twin_tensor": (_unprefixed_twin, AdapterLoadError, "would be unused"),
    # Linear-time matching: each is matched in microseconds and refused for matching no module.
    "target_regex_exponential": (
        _edit_config(target_modules=r"(([a-z_.0-9]*)*)*!"),
        AdapterLoadError,
        "tensors for modules the config's target_modules",
    ),
    "rank_pattern_key_exponential": (
        _edit_config(rank_pattern={"(a|ab)*c": 4}),
        AdapterLoadError,
        "key '\\(a\\|ab\\)\\*c' matches no module",
    ),
    "regex_with_many_repetitions": (
        _edit_config(target_modules=".?" * 24 + ".{19}X"),
        AdapterLoadError,
        "tensors for modules the config's target_modules",
    ),
    "regex_with_lookahead": (
        _edit_config(target_modules=r"^(?!.*k_proj).*\.q_proj"),
        AdapterLoadError,
        "uses look-around",
    ),
    "regex_optional_inside_repetition": (
        _edit_config(target_modules=r"(?:.?){26}.{18}X"),
        AdapterLoadError,
        "tensors for modules the config's target_modules",
    ),
    "layers_pattern_not_text": (
        _edit_config(layers_pattern=5, layers_to_transform=[0]),
        AdapterLoadError,
        "'layers_pattern' must be a string or a list of strings, got 5",
    ),
    "exclude_modules_not_text": (
        _edit_config(exclude_modules=5),
        AdapterLoadError,
        "'exclude_modules' must be a regex string or a list of names, got 5",
    ),
    "exclude_modules_bad_regex": (_edit_config(exclude_modules="(q"), AdapterLoadError, "not a valid regex"),
    "weights_unreadable": (_replace_by_directory(WEIGHTS), AdapterLoadError, "not a regular file"),
    "config_unreadable": (_replace_by_directory(CONFIG), AdapterLoadError, "not a regular file"),
    "file_too_large": (_huge_sparse, AdapterLoadError, r"above the limit max_file_bytes=17179869184"),
    "too_many_tensors": (_many_tensors, AdapterLoadError, "70000 tensors, above the limit max_tensors"),
    "pickle_only": (_pickle_only, UnsafeFormatError, "pickle"),
    "path_is_a_file": (_a_file, AdapterLoadError, "is not a directory"),
    "path_with_dot_dot": (_dot_dot, PathNotAllowedError, "contains '..'"),
    "absolute_path_outside_root": (_absolute_outside, PathNotAllowedError, "outside every allowed root"),
    "symlinked_directory_out_of_root": (_symlinked_dir, PathNotAllowedError, "outside every allowed root"),
    "symlinked_weights_out_of_root": (_symlinked_weights, PathNotAllowedError, "outside every allowed root"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_adapter_is_refused_and_changes_nothing(served: Served, case: str) -> None:
    breaker, error, pattern = CASES[case]
    copy = served.root / f"broken_{case}"
    shutil.copytree(served.good, copy)
    path = breaker(copy, served)
    before = snapshot(served.mgr)
    with pytest.raises(error, match=pattern) as caught:
        served.mgr.load(case, path)
    assert f"adapter {case!r}" in str(caught.value), "the message must name the adapter"
    assert case not in served.mgr.registry and case not in served.mgr.host
    assert_same(before, snapshot(served.mgr))
    with torch.no_grad(), served.mgr.batch(BATCH):
        logits = served.model(served.ids).logits
    assert torch.equal(logits, served.logits), "another adapter's (or the base model's) output changed"


def _replace_with_doubled_weights(path: Path) -> None:
    # Another writer replaces the file half-way through the read (a new inode, as a copy would).
    tensors = load_file(path)
    save_file({k: v * 2 for k, v in tensors.items()}, path.with_name("next.safetensors"))
    os.replace(path.with_name("next.safetensors"), path)


def _rewrite_in_place_keeping_mtime(path: Path) -> None:
    # Same inode, same size, mtime put back: only the change time tells.
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(4)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("rewrite", [_replace_with_doubled_weights, _rewrite_in_place_keeping_mtime])
def test_file_changing_while_read_is_refused(
    served: Served, monkeypatch: pytest.MonkeyPatch, rewrite: Callable[[Path], None]
) -> None:
    name = f"changes_while_read{rewrite.__name__}"
    copy = served.root / name
    shutil.copytree(served.good, copy)
    rewritten: list[str] = []

    def rewriting_first(original: Callable[..., list[int | None]]) -> Callable[..., list[int | None]]:
        def rewrite_then_read(self: AdapterFile, reads: Any, *args: Any) -> list[int | None]:
            if not rewritten:
                rewrite(self.weights_path)
                rewritten.append(reads[0][0])
            return original(self, reads, *args)

        return rewrite_then_read

    # read_at: the read of a load whose layout an earlier load of the same config and header decided.
    for method in ("read_many", "read_at"):
        monkeypatch.setattr(AdapterFile, method, rewriting_first(getattr(AdapterFile, method)))
    before = snapshot(served.mgr)
    with pytest.raises(AdapterLoadError, match=rf"'{name}'.*changed while it was read"):
        served.mgr.load(name, copy)
    assert rewritten
    assert_same(before, snapshot(served.mgr))
    monkeypatch.undo()
    if rewrite is _replace_with_doubled_weights:
        served.mgr.load(name, copy)  # the file is whole again: it loads
        served.mgr.unload(name)


def test_the_corpus_is_big_enough_and_the_template_loads(served: Served) -> None:
    assert len(CASES) + 1 >= 20
    served.mgr.load("template_copy", served.good)
    served.mgr.unload("template_copy")


def test_limits_are_keyword_arguments(served: Served) -> None:
    from lora_pin import HostTier, load_adapter

    targets = served.mgr.targets
    with pytest.raises(AdapterLoadError, match=r"'tight'.*16 tensors, above the limit max_tensors=15"):
        load_adapter("tight", served.good, targets, max_rank=8, dtype=torch.float32, max_tensors=15)
    size = (served.good / WEIGHTS).stat().st_size
    with pytest.raises(
        AdapterLoadError, match=rf"'tight'.*{size} bytes, above the limit max_file_bytes=1000"
    ):
        load_adapter("tight", served.good, targets, max_rank=8, dtype=torch.float32, max_file_bytes=1000)
    adapter = load_adapter(
        "exact", served.good, targets, max_rank=8, dtype=torch.float32, max_tensors=16, max_file_bytes=size
    )
    assert adapter.tensors_applied == 16
    tier = HostTier(targets, max_rank=8, dtype=torch.float32, max_tensors=15)
    with pytest.raises(AdapterLoadError, match="max_tensors=15"):
        tier.load("tight", served.good)
    assert len(tier) == 0
