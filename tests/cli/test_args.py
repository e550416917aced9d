"""Server arguments as SGLang and vLLM users write them: ``add_lora_args`` / ``lora_config_from_args``
(SGLang's flags and defaults) and ``add_vllm_lora_args`` / ``lora_config_from_vllm_args`` (vLLM's)."""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import lora_pin
from lora_pin import LoRAManager
from lora_pin.errors import SpecError

ATTN = ["q_proj", "v_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def sglang(argv: list[str]) -> Any:
    return lora_pin.lora_config_from_args(lora_pin.add_lora_args(argparse.ArgumentParser()).parse_args(argv))


def vllm(argv: list[str]) -> Any:
    parser = lora_pin.add_vllm_lora_args(argparse.ArgumentParser())
    return lora_pin.lora_config_from_vllm_args(parser.parse_args(argv))


def test_no_lora_flag_means_lora_is_off_as_in_sglang(tiny_llama: torch.nn.Module) -> None:
    assert sglang([]) is None
    assert sglang(["--max-loras-per-batch", "4"]) is None  # a default-valued knob alone turns nothing on
    with pytest.raises(SpecError, match="LoRA is off"):
        LoRAManager.from_args(copy.deepcopy(tiny_llama), argparse.Namespace(lora_paths=None))
    cfg = sglang(["--lora-paths", "a=/a"])
    assert cfg is not None and [r.lora_name for r in cfg.refs] == ["a"]


def test_enable_lora_with_all_and_no_start_up_adapters_serves_any_module(
    tiny_llama: torch.nn.Module, make_adapters: Any, tmp_path: Path
) -> None:
    """SGLang's own tests start servers with ``--enable-lora --max-lora-rank 256 --lora-target-modules all``
    and no ``--lora-paths``: every supported module is wrapped, so any adapter loads later."""
    cfg = sglang(["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"])
    assert cfg.refs == () and cfg.target_modules == ("all",)
    mgr = LoRAManager.from_config(copy.deepcopy(tiny_llama), cfg)
    assert set(mgr.targets.module_names) >= {*ATTN, "k_proj", "o_proj", *MLP}
    paths = make_adapters(
        tmp_path,
        {
            "mlp": dict(r=4, lora_alpha=8, target_modules=MLP),
            "attn": dict(r=8, lora_alpha=8, target_modules=ATTN),
        },
    )
    mgr.load("mlp", paths["mlp"])
    mgr.load("attn", paths["attn"])


def test_all_with_a_q_v_start_up_adapter_still_takes_an_mlp_adapter_later(
    tiny_llama: torch.nn.Module, make_adapters: Any, tmp_path: Path
) -> None:
    paths = make_adapters(
        tmp_path,
        {
            "qv": dict(r=4, lora_alpha=8, target_modules=ATTN),
            "mlp": dict(r=4, lora_alpha=8, target_modules=MLP),
        },
    )
    cfg = sglang(["--lora-paths", f"qv={paths['qv']}", "--lora-target-modules", "all"])
    mgr = LoRAManager.from_config(copy.deepcopy(tiny_llama), cfg)
    mgr.load("mlp", paths["mlp"])
    assert mgr.max_rank == 4, "the pool's rank still comes from the start-up adapter"


def test_all_without_a_rank_and_adapters_names_the_missing_flag(tiny_llama: torch.nn.Module) -> None:
    with pytest.raises(SpecError, match=r"max_lora_rank is required.*'all'"):
        LoRAManager(copy.deepcopy(tiny_llama), None, lora_target_modules=["all"])
    with pytest.raises(SpecError, match="are required"):
        sglang(["--enable-lora", "--lora-target-modules", "all"])


@pytest.mark.parametrize(
    "item", ["a =/p", "a= /p", '{"lora_name": " a", "lora_path": "/p"}', '{"name": "a ", "path": "/p"}']
)
def test_names_and_paths_with_surrounding_whitespace_are_refused(item: str) -> None:
    """SGLang keeps the spaces (``a =/p`` names ``'a '``); trimming would give another name and id."""
    with pytest.raises(SpecError, match="leading or trailing whitespace"):
        lora_pin.parse_lora_paths([item])
    with pytest.raises(SpecError, match="leading or trailing whitespace"):
        lora_pin.LoRARef.new("a ", "/p")


class _SGLangLoRARef:
    """What SGLang's own ``--lora-paths`` action makes of an item: an object, not a string."""

    def __init__(self, lora_name: str, lora_path: str, pinned: bool = False) -> None:
        self.lora_name, self.lora_path, self.pinned = lora_name, lora_path, pinned


class _SGLangPathsAction(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        refs = []
        for v in values:
            name, _, path = v.partition("=")
            refs.append(_SGLangLoRARef(name, path, pinned=name.startswith("pin")))
        setattr(namespace, self.dest, refs)


def test_a_parser_that_already_has_the_flags_is_reused() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora-paths", nargs="*", action=_SGLangPathsAction, default=None)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    lora_pin.add_lora_args(parser)  # raised "conflicting option string" before
    cfg = lora_pin.lora_config_from_args(parser.parse_args(["--lora-paths", "a=/a", "pinned=/b"]))
    assert [(r.lora_name, r.lora_path, r.pinned) for r in cfg.refs] == [
        ("a", "/a", False),
        ("pinned", "/b", True),
    ]
    with pytest.raises(argparse.ArgumentError):
        lora_pin.add_lora_args(
            argparse.ArgumentParser(exit_on_error=False), skip_existing=False
        ).add_argument("--lora-paths")


def test_a_prefix_keeps_the_flags_apart() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora-paths", nargs="*", default=None)  # the framework's own, other meaning
    lora_pin.add_lora_args(parser, prefix="lp-")
    ns = parser.parse_args(["--lora-paths", "x", "--lp-lora-paths", "a=/a", "--lp-max-loras-per-batch", "2"])
    cfg = lora_pin.lora_config_from_args(ns, prefix="lp-")
    assert [r.lora_name for r in cfg.refs] == ["a"] and cfg.max_loras_per_batch == 2
    assert ns.lora_paths == ["x"]


def test_vllm_flags_and_defaults() -> None:
    assert vllm([]) is None
    assert vllm(["--max-loras", "4"]) is None, "vLLM serves no adapter without --enable-lora"
    cfg = vllm(["--enable-lora"])
    assert (cfg.max_loras_per_batch, cfg.max_loaded_loras, cfg.max_lora_rank) == (1, 1, 16)
    assert cfg.target_modules == ("all",) and cfg.refs == () and cfg.lora_dtype == "auto"
    cfg = vllm(
        [
            "--enable-lora",
            "--lora-modules",
            "a=/a",
            '{"name": "b", "path": "/b", "base_model_name": "llama"}',
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "6",
            "--max-lora-rank",
            "64",
            "--lora-dtype",
            "bfloat16",
        ]
    )
    assert [(r.lora_name, r.base_model_name) for r in cfg.refs] == [("a", None), ("b", "llama")]
    assert (cfg.max_loras_per_batch, cfg.max_loaded_loras, cfg.max_lora_rank, cfg.lora_dtype) == (
        2,
        6,
        64,
        "bfloat16",
    )
    with pytest.raises(SpecError, match="needs --enable-lora"):
        vllm(["--lora-modules", "a=/a"])
    with pytest.raises(SpecError, match=r"--max-cpu-loras=1 must be >= --max-loras=2"):
        vllm(["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"])
    with pytest.raises(SpecError, match=r"--max-loras must be at least 1 \(got 0\)"):
        vllm(["--enable-lora", "--max-loras", "0"])


def test_vllm_config_serves_every_module_and_checks_the_dtype(
    tiny_llama: torch.nn.Module, make_adapters: Any, tmp_path: Path
) -> None:
    paths = make_adapters(tmp_path, {"mlp": dict(r=4, lora_alpha=8, target_modules=MLP)})
    cfg = vllm(["--enable-lora", "--lora-modules", f"mlp={paths['mlp']}", "--max-loras", "2"])
    mgr = LoRAManager.from_config(copy.deepcopy(tiny_llama), cfg)
    assert mgr.max_rank == 16 and "q_proj" in mgr.targets.module_names
    with pytest.raises(SpecError, match=r"lora_dtype='float16' but the model is torch\.float32"):
        LoRAManager.from_config(copy.deepcopy(tiny_llama), vllm(["--enable-lora", "--lora-dtype", "float16"]))
    LoRAManager.from_config(copy.deepcopy(tiny_llama), vllm(["--enable-lora", "--lora-dtype", "float32"]))


@dataclass
class LoRAModulePath:
    """vLLM's own (``vllm.entrypoints.openai.models.protocol``), as its API docs define it."""

    name: str
    path: str
    base_model_name: str | None = None


class _VLLMLoRAParserAction(argparse.Action):
    """vLLM's ``--lora-modules`` action: ``NAME=PATH`` or a JSON object, each made a ``LoRAModulePath``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        modules = []
        for item in values:
            if "=" in item and "," not in item:
                name, path = item.split("=")
                modules.append(LoRAModulePath(name, path))
            else:
                modules.append(LoRAModulePath(**json.loads(item)))
        setattr(namespace, self.dest, modules)


def test_vllm_own_lora_modules_action_is_read() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora-modules", nargs="+", action=_VLLMLoRAParserAction, default=None)
    lora_pin.add_vllm_lora_args(parser)
    modules = ["a=/a", '{"name": "b", "path": "/b", "base_model_name": "m"}']
    argv = ["--enable-lora", "--max-loras", "2", "--lora-modules", *modules]
    cfg = lora_pin.lora_config_from_vllm_args(parser.parse_args(argv))
    assert [(r.lora_name, r.lora_path, r.base_model_name, r.pinned) for r in cfg.refs] == [
        ("a", "/a", None, False),
        ("b", "/b", "m", False),
    ]


def test_max_lora_rank_is_checked_against_the_managers_limit() -> None:
    from lora_pin.weights.limits import MAX_ADAPTER_RANK

    cfg = sglang(["--lora-paths", "a=/a", "--max-lora-rank", str(MAX_ADAPTER_RANK)])
    assert cfg.max_lora_rank == MAX_ADAPTER_RANK
    over = str(MAX_ADAPTER_RANK + 1)
    with pytest.raises(
        SpecError, match=rf"--max-lora-rank must be in 1\.\.{MAX_ADAPTER_RANK} \(got {over}\)"
    ):
        sglang(["--lora-paths", "a=/a", "--max-lora-rank", over])
    with pytest.raises(SpecError, match=rf"--max-lora-rank must be in 1\.\.{MAX_ADAPTER_RANK}"):
        vllm(["--enable-lora", "--max-lora-rank", over])


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (5, r"--lora-target-modules must be a list of module names, got int"),
        ("q_proj", r"--lora-target-modules must be a list of module names, got the str 'q_proj'"),
        (["q_proj", 5], r"--lora-target-modules\[1\] must be a module name \(str\), got int"),
        (["q_proj", None], r"--lora-target-modules\[1\] must be a module name \(str\), got NoneType"),
        (["q_proj", " "], r"--lora-target-modules\[1\] is an empty module name"),
    ],
)
def test_non_str_target_modules_are_named_by_type_and_position(targets: Any, message: str) -> None:
    ns = argparse.Namespace(lora_paths=["a=/a"], lora_target_modules=targets)
    with pytest.raises(SpecError, match=message):
        lora_pin.lora_config_from_args(ns)


def test_a_framework_store_true_enable_lora_with_lora_paths_alone_warns_and_serves() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-lora", action="store_true")  # default False, as frameworks write it
    lora_pin.add_lora_args(parser)
    with pytest.warns(UserWarning, match=r"--lora-paths.*enable_lora is False"):
        cfg = lora_pin.lora_config_from_args(parser.parse_args(["--lora-paths", "a=/a"]))
    assert cfg is not None and [r.lora_name for r in cfg.refs] == ["a"]
    assert lora_pin.lora_config_from_args(parser.parse_args([])) is None


def test_parse_bytes_takes_ints_and_numbers_with_units() -> None:
    from lora_pin.args import parse_bytes

    cases = {"512MiB": 512 << 20, "2GB": 2 * 10**9, "1.5GiB": 3 << 29, "4096": 4096, " 8 kib ": 8192, "3b": 3}
    for text, want in cases.items():
        assert parse_bytes("x", text) == want, text
    assert parse_bytes("x", 7) == 7
    for bad in ("", "MiB", "-1MiB", "2 parsecs", "0", "1e9"):
        with pytest.raises(SpecError, match=r"x must be"):
            parse_bytes("x", bad)
    for bad_value in (True, 0, -3, 1.5):
        with pytest.raises(SpecError, match=r"x must be"):
            parse_bytes("x", bad_value)  # type: ignore[arg-type]
