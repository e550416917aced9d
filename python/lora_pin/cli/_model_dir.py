"""Checking a ``--model`` argument before transformers sees it."""

from __future__ import annotations

import os

from lora_pin.errors import SpecError

__all__ = ["local_model_dir"]


def local_model_dir(path: str | os.PathLike[str]) -> str:
    """``path`` as a local Hugging Face model folder (one holding ``config.json``).

    Checked here because transformers takes anything else for a model id on the Hub: it would try the
    network, or fail with a message about repository names.

    Raises:
        SpecError: ``path`` is not a folder with a ``config.json``.
    """
    text = os.fspath(path)
    if not os.path.isdir(text):
        raise SpecError(f"--model: {text!r} is not a folder (a local Hugging Face model folder is needed)")
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise SpecError(f"--model: {text!r} has no config.json, so it is not a Hugging Face model folder")
    return text
