"""Run by tests/vllm/test_contract.py in the vLLM venv: every vLLM seam the plugin relies on
(``lora_pin.vllm.seams.SEAMS``) is where it was and looks as it did, and vLLM's plugin loader runs the
plugin only when ``VLLM_PLUGINS`` names it. Prints one JSON object: ``{"broken": [seam: why, ...],
"loaded": bool}``; argv[1] is ``"on"`` or ``"off"`` (whether this process has VLLM_PLUGINS=lora_pin).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import vllm

from lora_pin.vllm import seams

broken: list[str] = []


def check(seam: str, ok: bool, why: str) -> None:
    if not ok:
        broken.append(f"{seam}: {why}")


check("vllm version", vllm.__version__.startswith(seams.VLLM_MINOR + "."), f"vLLM is {vllm.__version__}")

for module_name, qualname, _ in seams.SEAMS:
    module = importlib.import_module(module_name)
    owner_name, _, attribute = qualname.rpartition(".")
    owner = getattr(module, owner_name or attribute, None)
    if owner is None:
        check(qualname, False, f"{owner_name or attribute} is gone from {module_name}")
        continue
    if not owner_name:
        continue
    if attribute in (
        "lora_index_to_id",
        "punica_wrapper_mapping",
        "pinned_items",
        "packed_modules",
        "packed_modules_mapping",
        "modules",
        "max_num_running_reqs",
        "prev_step_scheduled_req_ids",
    ):
        # Instance attributes: set in the manager's own methods.
        source = inspect.getsource(owner)
        check(qualname, f"self.{attribute}" in source, f"{owner_name} no longer sets self.{attribute}")
    else:
        check(qualname, hasattr(owner, attribute), f"{owner_name}.{attribute} is gone")

from vllm.lora.model_manager import LoRAModelManager  # noqa: E402
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperABC  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

params = list(inspect.signature(LoRAModelManager.activate_adapter).parameters)
check("LoRAModelManager.activate_adapter", params == ["self", "lora_id"], f"its parameters are {params}")
from vllm.entrypoints.openai.models.serving import OpenAIServingModels  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys  # noqa: E402
from vllm.v1.engine.input_processor import InputProcessor  # noqa: E402

check(
    "generate_block_hash_extra_keys",
    "request.cache_salt" in inspect.getsource(generate_block_hash_extra_keys)
    and "_gen_lora_extra_hash_keys(request)" in inspect.getsource(generate_block_hash_extra_keys),
    "block hashes no longer read the request's cache_salt, or its LoRA keys from _gen_lora_extra_hash_keys",
)
check(
    "InputProcessor.process_inputs",
    "cache_salt=" in inspect.getsource(InputProcessor.process_inputs)
    or "cache_salt=" in inspect.getsource(InputProcessor),
    "the engine request is no longer built with a cache_salt",
)
check(
    "OpenAIServingModels.load_lora_adapter",
    inspect.iscoroutinefunction(OpenAIServingModels.load_lora_adapter)
    and "self.lora_requests[lora_name] = lora_request" in inspect.getsource(OpenAIServingModels),
    "it is no longer a coroutine that records the loaded LoRARequest in self.lora_requests",
)
# The punica wrapper skips a slot in the linear layers its adapter has no weights for: right only while
# activation zeroes the slot there (reset_lora) and fills it from _get_lora_layer_weights otherwise.
activate = inspect.getsource(LoRAModelManager.activate_adapter)
check(
    "LoRAModelManager.activate_adapter",
    "self._get_lora_layer_weights(lora_model, module_name)" in activate
    and "module.reset_lora(index)" in activate
    and "module.set_lora(" in activate,
    "activation no longer zeroes a slot in the layers its adapter has no weights for (reset_lora)",
)
check(
    "LoRAModelManager._registered_adapters",
    "self._registered_adapters" in inspect.getsource(LoRAModelManager),
    "the manager no longer keeps _registered_adapters",
)
# The methods vLLM's LoRA layers call on a punica wrapper: a new one is math the plugin does not do yet.
abstract = sorted(PunicaWrapperABC.__abstractmethods__)
known = [
    "add_expand",
    "add_lora_embedding",
    "add_lora_linear",
    "add_lora_logits",
    "add_shrink",
    "apply_lora_full_linear",
    "update_metadata",
]
check("PunicaWrapperABC", abstract == known, f"its abstract methods are {abstract}")

if sys.argv[1] == "off":
    check(
        "CpuPlatform.get_punica_wrapper",
        CpuPlatform.get_punica_wrapper().endswith("PunicaWrapperCPU"),
        f"it names {CpuPlatform.get_punica_wrapper()}",
    )

# LORA_PIN_VLLM_COMPILE undoes exactly this: the platform turns VLLM_COMPILE into DYNAMO_TRACE_ONCE (its
# inductor settings made there), then sets NONE whenever LoRA is on. When a release compiles LoRA on CPU
# itself, or compiles it another way, this fails.
platform_check = inspect.getsource(CpuPlatform.check_and_update_config)
lora_off = (
    "if vllm_config.lora_config is not None:\n            compilation_config.mode = CompilationMode.NONE"
)
check(
    "CpuPlatform.check_and_update_config",
    "compilation_config.mode = CompilationMode.DYNAMO_TRACE_ONCE" in platform_check
    and lora_off in platform_check
    and platform_check.index("CompilationMode.DYNAMO_TRACE_ONCE") < platform_check.index(lora_off),
    "it no longer compiles VLLM_COMPILE as DYNAMO_TRACE_ONCE and then turns compilation off with LoRA",
)

from vllm.lora.peft_helper import PEFTHelper  # noqa: E402


def dora_refused() -> bool:
    """Whether vLLM's PEFT config check refuses ``use_dora`` (the plugin lifts exactly that refusal)."""
    helper = PEFTHelper(r=1, lora_alpha=1, target_modules=["q_proj"], use_dora=True)
    return any("DoRA" in message for message in helper._validate_features())


if sys.argv[1] == "off":
    check("PEFTHelper._validate_features", dora_refused(), "vLLM no longer refuses use_dora")
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402

check(
    "dispatch_cpu_unquantized_gemm",
    "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm"
    in inspect.getsource(UnquantizedLinearMethod.process_weights_after_loading),
    "the CPU weight packing no longer looks dispatch_cpu_unquantized_gemm up in its module when called",
)

from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()
loaded = CpuPlatform.get_punica_wrapper() == seams.PUNICA_WRAPPER
if loaded:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from lora_pin.vllm.punica import LoraPinPunicaWrapper

    check(
        "punica wrapper qualname",
        resolve_obj_by_qualname(seams.PUNICA_WRAPPER) is LoraPinPunicaWrapper,
        "it does not resolve to LoraPinPunicaWrapper",
    )
    check("activate_adapter patch", LoRAModelManager.activate_adapter.__wrapped__ is not None, "not patched")
    check(
        "check_and_update_config patch",
        getattr(CpuPlatform.check_and_update_config, "__wrapped__", None) is not None,
        "not patched",
    )
    check("DoRA refusal lifted", not dora_refused(), "vLLM still refuses use_dora with the plugin")
print(json.dumps({"broken": broken, "loaded": loaded}))
