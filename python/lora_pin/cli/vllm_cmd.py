"""``lora-pin vllm-serve``: ``vllm serve`` with lora_pin's plugin switched on (``lora_pin.vllm``).

The one switch: it adds ``lora_pin`` to ``VLLM_PLUGINS`` (keeping any plugins already named there),
passes ``--scheduler-cls lora_pin.vllm.Scheduler`` unless another is given, takes ``"pinned": true`` out
of ``--lora-modules`` JSON items (vLLM's parser refuses the key) and names those adapters in
``LORA_PIN_VLLM_PINNED`` for the plugin to pin, and runs ``vllm serve`` with every other argument as
given, in this Python (the venv vLLM is installed in). The environment passes through, so the plugin's
switches (``LORA_PIN_VLLM_ROTATE``, ``LORA_PIN_VLLM_AGE_BOUND``, ``LORA_PIN_VLLM_COMPILE``) reach vLLM's
processes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from typing import Any

__all__ = [
    "PINNED_ENV",
    "PLUGIN_NAME",
    "SCHEDULER",
    "add_parser",
    "plugin_environment",
    "run",
    "vllm_serve_command",
]

PLUGIN_NAME = "lora_pin"  # what lora_pin.vllm answers to in VLLM_PLUGINS
SCHEDULER = "lora_pin.vllm.Scheduler"
PINNED_ENV = "LORA_PIN_VLLM_PINNED"  # lora_pin.vllm.pins.PINNED_ENV


def add_parser(subparsers: Any) -> None:
    """Registers ``vllm-serve`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "vllm-serve",
        help="vllm serve with lora_pin's plugin (pass vllm serve's arguments)",
        description=(
            "Run `vllm serve` with lora_pin's plugin: every LoRA layer on lora_pin's ops (base rows "
            "batched with adapters stay exact; each adapter at its own rank). Arguments are vllm serve's; "
            "the environment passes through (LORA_PIN_VLLM_ROTATE=1: the scheduler rotates adapter slots, "
            "docs/vllm.md)."
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


def vllm_serve_command(vllm_args: list[str]) -> tuple[list[str], list[str]]:
    """The command that runs ``vllm serve`` in this Python with ``vllm_args`` (pins taken out of its
    ``--lora-modules`` items, the scheduler added), and the adapters pinned at start-up.

    Raises:
        SpecError: a ``--lora-modules`` item's ``"pinned"`` is not a boolean.
    """
    from lora_pin.errors import SpecError
    from lora_pin.vllm.pins import split_pinned_modules

    args, pinned = list(vllm_args), []
    if "--lora-modules" in args:
        start = args.index("--lora-modules") + 1
        end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
        try:
            args[start:end], pinned = split_pinned_modules(args[start:end])
        except ValueError as e:
            raise SpecError(str(e)) from None
    if not any(a == "--scheduler-cls" or a.startswith("--scheduler-cls=") for a in args):
        args += ["--scheduler-cls", SCHEDULER]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args], pinned


def run(args: argparse.Namespace) -> int:
    """Replaces this process with ``vllm serve`` (does not return when vLLM is installed).

    Raises:
        ModuleNotFoundError: vLLM is not installed in this Python (the CLI names the extra).
    """
    if importlib.util.find_spec("vllm") is None:
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
    command, pinned = vllm_serve_command(list(args.vllm_args))
    env = plugin_environment(dict(os.environ))
    env[PINNED_ENV] = ",".join(pinned)
    os.execve(command[0], command, env)
