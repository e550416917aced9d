"""The ``lora-pin`` command: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lora_pin import __version__
from lora_pin.cli import demo_cmd, inspect_cmd, parse_cmd, simulate_cmd
from lora_pin.errors import LoraPinError

__all__ = ["main"]

_SUBCOMMANDS = (demo_cmd, parse_cmd, inspect_cmd, simulate_cmd)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="lora-pin", description="Serve many LoRA adapters over one base model."
    )
    parser.add_argument("--version", action="version", version=f"lora-pin {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 bad input, 1 a failed check)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except LoraPinError as e:
        print(f"lora-pin {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
