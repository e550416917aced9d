"""Limits that keep one hostile adapter from exhausting memory or time.

An adapter directory is read from a path a client may name, so its files are treated as untrusted input.
Before a byte of a tensor is read, the loader checks the config file's size, the weight file's size, the
number of tensors in it and the ranks its config declares; each refusal is an
:class:`~lora_pin.errors.AdapterLoadError` naming the adapter, the file, the limit and the value found.

The defaults admit every real adapter we know of (the largest published LoRA adapters have a few thousand
tensors, ranks up to 1024 and a few GiB of weights) and stop absurd ones long before memory runs out.
``max_file_bytes`` and ``max_tensors`` are keyword arguments of :func:`~lora_pin.weights.load_adapter`,
:class:`~lora_pin.weights.HostTier` and :class:`~lora_pin.model.LoRAManager`; the rank limit per deployment
is the slot pool's ``max_rank``; :data:`MAX_ADAPTER_RANK` bounds what a config may declare at all.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lora_pin import _core
from lora_pin.errors import AdapterLoadError

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_TENSORS",
    "MAX_ADAPTER_RANK",
    "MAX_CONFIG_BYTES",
    "check_count",
    "check_file_size",
]

DEFAULT_MAX_FILE_BYTES = 16 << 30
"""Largest weight file read (16 GiB): a rank-1024 adapter on every linear of a 70B model is ~13 GiB."""

DEFAULT_MAX_TENSORS = 65_536
"""Most tensors one weight file may hold: 2 per targeted linear, ~1,800 for a 405B model's 7 linears."""

MAX_ADAPTER_RANK: int = _core.MAX_ADAPTER_RANK
"""Largest ``r`` (or ``rank_pattern`` value) a config may declare and ``max_lora_rank`` a pool may take
(16,384); above every model's hidden size in use, so no real adapter reaches it, and a pool sized from a
config can never be asked for more. Defined in the core, so that the argument helpers check the same
number without importing torch."""

MAX_CONFIG_BYTES = 1 << 20
"""Largest ``adapter_config.json`` read (1 MiB); PEFT writes about 1 KiB."""


def check_file_size(name: str, path: Path, limit: int, what: str) -> int:
    """The size of ``path`` in bytes, refused above ``limit``.

    Raises:
        AdapterLoadError: the file is larger than ``limit`` (the message names ``what`` the limit is), is
            not a regular file, or cannot be stat-ed.
    """
    try:
        info = os.stat(path)
    except OSError as exc:
        raise AdapterLoadError(f"adapter {name!r} ({path}): cannot stat the file: {exc}") from None
    if not stat.S_ISREG(info.st_mode):
        # Opening a FIFO would block until someone writes to it; a device could be endless.
        raise AdapterLoadError(f"adapter {name!r} ({path}): not a regular file (a FIFO, device or folder)")
    size = info.st_size
    if size > limit:
        raise AdapterLoadError(
            f"adapter {name!r} ({path}): file is {size} bytes, above the limit {what}={limit}"
        )
    return size


def check_count(name: str, path: Path, count: int, limit: int) -> None:
    """Refuse a weight file holding more than ``limit`` tensors.

    Raises:
        AdapterLoadError: ``count > limit``; the message names the limit ``max_tensors`` and the count.
    """
    if count > limit:
        raise AdapterLoadError(
            f"adapter {name!r} ({path}): file holds {count} tensors, above the limit max_tensors={limit}"
        )
