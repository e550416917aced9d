"""An unload that times out says the same thing whichever way it waited: the core writes the text."""

from __future__ import annotations

import asyncio
import re

import pytest

from lora_pin import LoRARef, LoRARegistry
from lora_pin._core import _unload_timeout_error
from lora_pin.errors import UnloadTimeoutError, UsageError
from lora_pin.unloading import unload_async


def without_seconds(message: str) -> str:
    return re.sub(r"after \d+\.\d{3} s", "after _ s", message)


def test_unload_async_times_out_with_the_blocking_unloads_message() -> None:
    reg = LoRARegistry(2, None)
    for name in ("a", "b"):
        reg.register(LoRARef(name, f"/srv/{name}"), rank=4, host_bytes=100, device_bytes=50)
    reg.begin_step(["a", "a", "b", "b"], 1)  # the open step holds two requests of each
    with pytest.raises(UnloadTimeoutError) as blocking:
        reg.unload("a", timeout=0.01)
    with pytest.raises(UnloadTimeoutError) as polled:
        asyncio.run(unload_async(reg, "b", timeout=0.01))
    expected = without_seconds(str(blocking.value)).replace('"a"', '"b"')
    assert without_seconds(str(polled.value)) == expected
    assert "2 request(s) still in flight" in expected


def test_the_error_refuses_a_time_that_is_no_duration() -> None:
    assert isinstance(_unload_timeout_error("a", 1, 0.5), UnloadTimeoutError)
    for waited in (-1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="waited"):
            _unload_timeout_error("a", 1, waited)
