"""``adapter_dir``: adapters found by name in a folder, loaded on first request."""

from __future__ import annotations

import os
from pathlib import Path

from lora_pin._core import LoRARegistry
from lora_pin.errors import AdapterNotFoundError, SpecError
from lora_pin.weights.reader import adapter_dir_for_name, path_within

__all__ = ["adapter_folders", "checked_adapter_dir"]


def checked_adapter_dir(
    adapter_dir: str | os.PathLike[str], allowed_roots: tuple[str | os.PathLike[str], ...] | None
) -> Path:
    """``adapter_dir`` resolved, checked to be a folder within ``allowed_roots`` (None: anywhere).

    Raises:
        SpecError: it is not a folder, or resolves outside every allowed root.
    """
    real = os.path.realpath(adapter_dir)
    if not os.path.isdir(real):
        raise SpecError(f"adapter_dir {os.fspath(adapter_dir)!r} is not a directory")
    if allowed_roots is not None:
        roots = [os.path.realpath(r) for r in allowed_roots]
        if not path_within(real, roots):
            raise SpecError(
                f"adapter_dir {os.fspath(adapter_dir)!r} resolves to {real!r}, outside every allowed "
                f"root {roots}"
            )
    return Path(real)


def adapter_folders(registry: LoRARegistry, root: Path | None, names: list[str]) -> dict[str, Path]:
    """The folder under ``root`` (the manager's ``adapter_dir``, or None) of each of ``names`` (none
    registered in ``registry``), by name.

    Raises:
        AdapterNotFoundError: a name is being unloaded, or there is no ``adapter_dir`` or no folder
            ``adapter_dir/<name>``.
        PathNotAllowedError: as :func:`~lora_pin.weights.reader.adapter_dir_for_name`.
    """
    for name in names:
        try:
            registry.in_flight(name)  # known though not registered: being unloaded
        except AdapterNotFoundError:
            continue
        raise AdapterNotFoundError(f"adapter {name!r} is being unloaded; it takes no new requests")
    if root is None:
        for name in names:
            registry.lora_ref(name)  # raises AdapterNotFoundError, listing what is registered
        return {}
    found: dict[str, Path] = {}
    for name in names:
        directory = adapter_dir_for_name(root, name)
        if directory is None:
            raise AdapterNotFoundError(
                f"adapter {name!r} is not registered, and {str(root / name)!r} does not exist"
            )
        found[name] = directory
    return found
