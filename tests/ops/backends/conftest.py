"""What the backend tests share: a recorder of the ops the dispatcher runs."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode


class OpCalls(TorchDispatchMode):
    """Records the name of every op the dispatcher runs while it is entered (``names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    @property
    def ours(self) -> list[str]:
        """The names of lora_pin's own ops among them."""
        return [name for name in self.names if name.startswith("lora_pin")]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def op_calls() -> type[OpCalls]:
    """:class:`OpCalls`, entered as ``with op_calls() as calls:``."""
    return OpCalls
