"""``lora-pin demo`` end to end: generated assets, a short replay checked against PEFT, the exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-cache")


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lora_pin", "demo", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_demo_serves_checks_and_reports(cache: Path) -> None:
    out = run_demo("--cache-dir", str(cache), "--requests", "60", "--check-every", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = orjson.loads(out.stdout)
    assert report["ok"] and report["checked_steps"] >= 3 and not report["failed_steps"]
    assert report["max_relative_error"] <= 1e-4
    assert report["adapter_effect"] > 1e-2, (
        "the adapters must change the outputs for the check to mean anything"
    )
    assert sorted(report["pinned"]) == ["chat", "math"] and report["pinned_evictions"] == {}
    stats = report["stats"]
    assert stats["device"]["evictions"] > 0 and stats["host"]["evictions"] > 0
    # Adapters evicted from host memory were read again by the background loader, never by a step.
    assert stats["background_loads"] > 0 and stats["background_load_failures"] == 0
    assert report["tokens"] > 0 and report["tokens_per_second"] > 0
    # Second run reuses the generated assets.
    again = run_demo("--cache-dir", str(cache), "--requests", "10", "--check-every", "0")
    assert again.returncode == 0, again.stderr
    assert "result          OK" in again.stdout and "pinned          chat, math" in again.stdout
    assert "of them in the background by the loader" in again.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-paths", "a=/nowhere"], "--lora-paths needs --model"),
        (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
        (["--requests", "-5"], "--requests must be at least 1 (got -5)"),
        (["--zipf-alpha", "nan"], "--zipf-alpha must be a finite number"),
        (["--model", "/nonexistent", "--lora-paths", "a=/x"], "--model: '/nonexistent' is not a folder"),
        (["--model", "/tmp", "--lora-paths", "a=/x"], "--model: '/tmp' has no config.json"),
    ],
)
def test_demo_bad_arguments_exit_2_with_one_line(cache: Path, argv: list[str], message: str) -> None:
    out = run_demo("--cache-dir", str(cache), *argv)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_demo_on_a_users_own_model_and_adapters(cache: Path) -> None:
    from lora_pin.demo.assets import ensure_demo_assets

    assets = ensure_demo_assets(cache)
    items = [f"mine={assets.adapter_dirs['law']}", f"other={assets.adapter_dirs['code']}"]
    out = run_demo(
        "--model", str(assets.model_dir), "--lora-paths", *items, "--requests", "20", "--check-every", "2",
        "--max-loras-per-batch", "2", "--max-loaded-loras", "2", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = orjson.loads(out.stdout)
    assert report["ok"] and report["checked_steps"] >= 2 and report["pinned"] == []


def test_demo_on_a_users_model_serves_an_adapter_on_lm_head(cache: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lora_pin.demo.assets import ensure_demo_assets
    from lora_pin.fixtures import save_peft_adapter

    assets = ensure_demo_assets(cache)
    base = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    head = save_peft_adapter(
        base, tmp_path / "head", 1, r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"]
    )
    items = [f"head={head}", f"law={assets.adapter_dirs['law']}"]
    common = [
        "--model",
        str(assets.model_dir),
        "--lora-paths",
        *items,
        "--requests",
        "20",
        "--check-every",
        "2",
    ]
    out = run_demo(
        *common, "--lora-target-modules", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "--json"
    )
    assert out.returncode == 0, out.stderr
    report = orjson.loads(out.stdout)
    assert report["ok"] and report["checked_steps"] >= 2
    # The default, every linear layer, leaves lm_head out as PEFT's all-linear does, and names it.
    refused = run_demo(*common)
    assert refused.returncode == 2 and "'lm_head'" in refused.stderr, refused.stderr
