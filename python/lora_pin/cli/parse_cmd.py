"""``lora-pin parse``: parse ``--lora-paths`` items and print the refs as a JSON array."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from lora_pin._core import parse_lora_paths
from lora_pin.args import DEFAULT_MAX_LORAS_PER_BATCH


def add_parser(subparsers: Any) -> None:
    """Registers ``parse`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "parse",
        help="parse --lora-paths items and print the adapters as JSON",
        description="Parse adapter specs exactly as a server would and print the refs as a JSON array.",
    )
    p.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=DEFAULT_MAX_LORAS_PER_BATCH,
        metavar="N",
        help="device slots: refuse more pinned adapters than N - 1 (default %(default)s, a server's)",
    )
    p.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        metavar="N",
        help="host-tier capacity: refuse more start-up adapters than N (default: no check)",
    )
    p.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="ITEM",
        required=True,
        help="adapter items as a server takes them: PATH, NAME=PATH, a JSON object, or @FILE (a JSON list)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prints ``[{lora_id, lora_name, lora_path, pinned, base_model_name}, ...]`` on stdout, with the limits
    a server applies by default (``--max-loras-per-batch`` 8).

    Raises:
        SpecError: an item or limit is invalid (the CLI turns it into one line on stderr and exit 2).
    """
    refs = parse_lora_paths(
        args.lora_paths,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
    )
    rows = [
        {
            "lora_id": r.lora_id,
            "lora_name": r.lora_name,
            "lora_path": r.lora_path,
            "pinned": r.pinned,
            "base_model_name": r.base_model_name,
        }
        for r in refs
    ]
    sys.stdout.buffer.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2) + b"\n")
    return 0
