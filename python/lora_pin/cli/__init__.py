"""The ``lora-pin`` command: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lora_pin import __version__
from lora_pin.cli import demo_cmd, inspect_cmd, parse_cmd, simulate_cmd
from lora_pin.errors import LoraPinError, SpecError

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


def _refuse_undecodable(argv: Sequence[str]) -> None:
    """Refuse an argument holding a lone surrogate, which is what Python makes of bytes in the command line
    that are not UTF-8: names and paths are text everywhere in lora_pin.

    Raises:
        SpecError: naming the argument's position and quoting it.
    """
    for position, arg in enumerate(argv, 1):
        if not arg.isascii():
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:
                raise SpecError(
                    f"argument {position} {arg!r} is not valid UTF-8 text (names and paths must be text)"
                ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 bad input, 1 a failed check)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _refuse_undecodable(argv)
    except SpecError as e:
        print(f"lora-pin: error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except LoraPinError as e:
        print(f"lora-pin {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
