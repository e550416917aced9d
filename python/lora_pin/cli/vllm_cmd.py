"""``lora-pin vllm-serve``: ``vllm serve`` with lora_pin's plugin switched on (``lora_pin.vllm``).

The one switch: it adds ``lora_pin`` to ``VLLM_PLUGINS`` (keeping any plugins already named there) and
runs ``vllm serve`` with every other argument as given, in this Python (the venv vLLM is installed in).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from typing import Any

__all__ = ["PLUGIN_NAME", "add_parser", "plugin_environment", "run", "vllm_serve_command"]

PLUGIN_NAME = "lora_pin"  # what lora_pin.vllm answers to in VLLM_PLUGINS (not imported: it imports vLLM)


def add_parser(subparsers: Any) -> None:
    """Registers ``vllm-serve`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "vllm-serve",
        help="vllm serve with lora_pin's plugin (pass vllm serve's arguments)",
        description=(
            "Run `vllm serve` with lora_pin's plugin: every LoRA layer on lora_pin's ops (base rows "
            "batched with adapters stay exact; each adapter at its own rank). Arguments are vllm serve's."
        ),
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="ARGS", help="vllm serve's arguments")
    p.set_defaults(run=run)


def plugin_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with ``lora_pin`` added to ``VLLM_PLUGINS``, a comma-separated allowlist. Unset, it
    means every installed general plugin: it is then set to all of them (lora_pin among them)."""
    env = dict(environ)
    named = [p.strip() for p in env.get("VLLM_PLUGINS", "").split(",") if p.strip()]
    if "VLLM_PLUGINS" not in env:
        named = sorted({e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")})
    if PLUGIN_NAME not in named:
        named.append(PLUGIN_NAME)
    env["VLLM_PLUGINS"] = ",".join(named)
    return env


def vllm_serve_command(vllm_args: list[str]) -> list[str]:
    """The command that runs ``vllm serve`` in this Python with ``vllm_args``."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *vllm_args]


def run(args: argparse.Namespace) -> int:
    """Replaces this process with ``vllm serve`` (does not return when vLLM is installed).

    Raises:
        ModuleNotFoundError: vLLM is not installed in this Python (the CLI names the extra).
    """
    if importlib.util.find_spec("vllm") is None:
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
    command = vllm_serve_command(list(args.vllm_args))
    os.execve(command[0], command, plugin_environment(dict(os.environ)))
