"""lora_pin inside vLLM: a plugin for ``vllm serve`` (``pip install 'lora_pin[vllm]'``).

Enabled with ``VLLM_PLUGINS=lora_pin`` (or ``lora-pin vllm-serve``, which sets it): vLLM then loads
:func:`register` in every one of its processes (the ``vllm.general_plugins`` entry point), and with it:

- every LoRA layer's math runs on lora_pin's ops (:class:`lora_pin.vllm.punica.LoraPinPunicaWrapper`):
  a base-model row batched with adapter rows stays bit-identical to a base-only run (vLLM's own CPU path
  gives it the last slot's adapter), and each slot multiplies only its adapter's rank;
- LoRA requests carry the adapter's digest in their ``cache_salt`` (:mod:`lora_pin.vllm.identity`): KV
  blocks are shared only under the same weights, and a reload in place gets fresh ones;
- pins (:mod:`lora_pin.vllm.pins`) and admission that counts them (:class:`Scheduler`, given with
  ``--scheduler-cls lora_pin.vllm.Scheduler``).

Installing lora_pin beside vLLM changes nothing until the plugin is named in ``VLLM_PLUGINS``: vLLM would
load every installed general plugin when that variable is unset, and a plugin that replaces the LoRA
math must be asked for. The vLLM version is pinned to one minor release (:data:`VLLM_MINOR`); any other
is refused at start-up, since the plugin reaches vLLM's internals (:mod:`lora_pin.vllm.seams`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lora_pin.vllm.seams import VLLM_MINOR, install

__all__ = ["PLUGIN_NAME", "VLLM_MINOR", "Scheduler", "register"]

#: The name the plugin is enabled by, in ``VLLM_PLUGINS``.
PLUGIN_NAME = "lora_pin"

_log = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run by vLLM in each of its processes (any number of
    times: it installs once per process).

    Raises:
        RuntimeError: the running vLLM is not of the minor version the plugin was built against.
    """
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None or PLUGIN_NAME not in [name.strip() for name in allowed.split(",")]:
        _log.info("lora_pin is installed but not enabled: set VLLM_PLUGINS=%s to enable it", PLUGIN_NAME)
        return
    install()


def __getattr__(name: str) -> Any:
    # vLLM resolves --scheduler-cls lora_pin.vllm.Scheduler in its engine process, where vLLM is loaded;
    # importing lora_pin.vllm alone (the entry points) does not import vLLM's scheduler.
    if name == "Scheduler":
        from lora_pin.vllm.scheduler import Scheduler

        return Scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
