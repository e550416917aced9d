"""Which adapter a request names, as the peers spell it.

- vLLM: ``"model": "<adapter>"`` (or the base model's name for the base);
- SGLang: ``"model": "<base>:<adapter>"``, or a ``lora_path`` body field holding the adapter's name.

A name that is neither the base nor a registered adapter is an error (404 in OpenAI's shape), never a
silent fall-back to the base model.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["UnknownModelError", "requested_adapter"]


class UnknownModelError(LookupError):
    """The request names a model that is neither the base nor a registered adapter."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


def requested_adapter(
    model: object, lora_path: object, base_name: str, is_adapter: Callable[[str], bool]
) -> str | None:
    """The adapter a request's ``model`` and ``lora_path`` fields name; None for the base model.

    ``lora_path`` (SGLang's field: an adapter name) wins when given; then ``model``: absent or the
    base's name is the base, ``<base>:<adapter>`` and ``<adapter>`` name an adapter.

    Raises:
        UnknownModelError: the adapter (or the model) named is not served; ``is_adapter`` says which
            names are.
        TypeError: a field is not a string.
    """
    if lora_path is not None:
        if not isinstance(lora_path, str):
            raise TypeError(f"lora_path must be a string (an adapter's name), got {type(lora_path).__name__}")
        if not is_adapter(lora_path):
            raise UnknownModelError(lora_path)
        return lora_path
    if model is None or model == base_name:
        return None
    if not isinstance(model, str):
        raise TypeError(f"model must be a string, got {type(model).__name__}")
    prefix = base_name + ":"
    name = model[len(prefix) :] if model.startswith(prefix) else model
    if not is_adapter(name):
        raise UnknownModelError(model)
    return name
