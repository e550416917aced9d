"""The ``lora-pin`` command: one subcommand per module in this package.

The subcommand modules import nothing heavy at module level (torch, transformers, peft load inside the
commands that use them), so ``lora-pin parse``, ``simulate``, ``--help`` and ``--version`` start without
paying for torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lora_pin import __version__
from lora_pin.cli import demo_cmd, inspect_cmd, parse_cmd, serve_cmd, simulate_cmd, vllm_cmd
from lora_pin.errors import LoraPinError, SpecError

__all__ = ["build_parser", "main"]

_SUBCOMMANDS = (demo_cmd, parse_cmd, inspect_cmd, simulate_cmd, serve_cmd, vllm_cmd)

# Optional dependencies by top-level module name, and the extra that installs them.
_EXTRAS = {
    "transformers": "hf",
    "peft": "hf",
    "prometheus_client": "metrics",
    "fastapi": "serve",
    "uvicorn": "serve",
    "vllm": "vllm",
}

# Conventional shell statuses: 128 + SIGINT, 128 + SIGPIPE.
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


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
    """Runs the CLI; returns the exit status.

    0 ok; 1 a failed check, or a missing optional dependency (the message names the extra to install);
    2 bad input (one line on stderr); 130 interrupted (Ctrl-C); 141 stdout closed early (a pipe into
    ``head``). None of these prints a traceback.
    """
    try:
        try:
            return _run(argv)
        finally:
            # A reader that went away shows up here, inside the handler below, instead of as
            # "Exception ignored" when the interpreter flushes stdout at exit.
            sys.stdout.flush()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The interpreter flushes stdout again at exit; point it at devnull so that flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
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
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top in _EXTRAS:
            print(
                f"lora-pin {args.command}: error: this command needs {top}, which is not installed; "
                f"install it with: pip install 'lora_pin[{_EXTRAS[top]}]'",
                file=sys.stderr,
            )
            return 1
        if top == "torch":
            print(
                f"lora-pin {args.command}: error: this command needs torch (a dependency of lora_pin), "
                "which is not installed; install it with: pip install torch",
                file=sys.stderr,
            )
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
