from collections.abc import Iterable, Mapping
from os import PathLike
from typing import Any, TypeAlias, final

__all__ = ["LoRARef", "__version__", "check_limits", "parse_lora_paths"]
__version__: str

@final
class LoRARef:
    def __new__(
        cls,
        lora_name: str,
        lora_path: str,
        *,
        pinned: bool = False,
        base_model_name: str | None = None,
        lora_id: str | None = None,
    ) -> LoRARef: ...
    @staticmethod
    def new(lora_name: str, lora_path: str, pinned: bool = False) -> LoRARef: ...
    @property
    def lora_id(self) -> str: ...
    @property
    def lora_name(self) -> str: ...
    @property
    def lora_path(self) -> str: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def base_model_name(self) -> str | None: ...
    def to_dict(self) -> dict[str, Any]: ...
    def to_spec(self) -> str: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

_SpecValue: TypeAlias = str | Mapping[str, str | bool | PathLike[str] | None] | LoRARef

def parse_lora_paths(
    values: Mapping[str, str] | Iterable[_SpecValue] | None,
    *,
    max_loras_per_batch: int | None = None,
    max_loaded_loras: int | None = None,
) -> list[LoRARef]: ...
def check_limits(
    num_adapters: int,
    num_pinned: int,
    *,
    max_loras_per_batch: int | None = None,
    max_loaded_loras: int | None = None,
) -> None: ...
