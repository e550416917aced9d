"""Which adapter a request names, in vLLM's and SGLang's spellings."""

from __future__ import annotations

import pytest

from lora_pin.serve.naming import UnknownModelError, requested_adapter

ADAPTERS = {"math", "team/style", "org:x"}


def named(model: object, lora_path: object = None) -> str | None:
    return requested_adapter(model, lora_path, "llama", ADAPTERS.__contains__)


def test_the_peers_spellings() -> None:
    assert named("llama") is None and named(None) is None
    assert named("math") == "math"  # vLLM
    assert named("llama:math") == "math"  # SGLang
    assert named("llama:team/style") == "team/style"
    assert named("llama", lora_path="math") == "math"  # SGLang's field wins
    assert named("org:x") == "org:x"  # a name with a colon that is not the base's prefix


@pytest.mark.parametrize(
    ("model", "lora_path"), [("nope", None), ("llama:nope", None), ("llama", "nope"), ("Math", None)]
)
def test_an_unknown_name_is_an_error_never_the_base(model: str, lora_path: str | None) -> None:
    with pytest.raises(UnknownModelError, match="does not exist"):
        named(model, lora_path)


def test_fields_of_another_type_are_refused() -> None:
    with pytest.raises(TypeError):
        named(["math"])
    with pytest.raises(TypeError):
        named("llama", lora_path=3)
