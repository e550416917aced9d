"""Fixtures of the CPU ops tests."""

from __future__ import annotations

import pytest

from lora_pin.ops import grouped


@pytest.fixture(params=["native", "torch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on the native kernels and on the torch path alone (``LORA_PIN_CPU_KERNELS=0``'s
    path); a module takes it for every test with ``pytestmark = pytest.mark.usefixtures("cpu_path")``."""
    native = request.param == "native"
    if native and not grouped.sgmv_cpu_available():
        pytest.skip("this CPU lacks AVX-512: only the torch path runs here")
    monkeypatch.setattr(grouped, "use_cpu_kernels", native)
    return str(request.param)
