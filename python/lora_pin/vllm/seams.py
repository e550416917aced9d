"""Every place where the plugin reaches into vLLM, in one file, checked by ``tests/vllm/test_contract.py``.

vLLM offers the seams the plugin needs (a platform's punica wrapper class, general plugins run in every
process, a request's ``cache_salt``) but not all as public API: the CPU platform names its punica
wrapper in a classmethod; the per-slot rank lora_pin uses (and a DoRA adapter's factors) is known only
when vLLM's LoRA model manager activates an adapter into a slot; DoRA adapters are read where vLLM's
worker loads an adapter (:mod:`lora_pin.vllm.dora`); a request's salt is set where vLLM builds the
engine request, and an adapter's digest read where the API server loads it
(:mod:`lora_pin.vllm.identity`); the CPU platform turns compilation off whenever LoRA is on, which
:data:`COMPILE_ENV` undoes (:func:`keeping_compilation`); a linear layer's slot is zeroed on every
activation, and :func:`zeroing_once` skips the slots that are zero already; an adapter with weights
outside ``--lora-target-modules`` is refused where the worker reads it, and a slot's memory is logged
where the LoRA layers are made (:mod:`lora_pin.vllm.targets`). All are patched here, once per process.
:data:`SEAMS` lists what is patched, so that the contract test fails loudly, naming the seam, when a
vLLM release moves one.
"""

from __future__ import annotations

import functools
import os
from typing import Any

__all__ = [
    "COMPILE_ENV",
    "PUNICA_WRAPPER",
    "SEAMS",
    "VLLM_MINOR",
    "adapter_rank",
    "compiling_asked",
    "install",
    "keeping_compilation",
    "zeroing_once",
]

#: The vLLM minor version the plugin is built against (the ``vllm`` extra pins the same).
VLLM_MINOR = "0.32"

#: The punica wrapper the CPU platform is made to name.
PUNICA_WRAPPER = "lora_pin.vllm.punica.LoraPinPunicaWrapper"

#: The environment variable that decides whether vLLM's compiled forward is kept with LoRA on (the CPU
#: platform runs the model eagerly whenever LoRA is on; the plugin's layers are traceable: its punica
#: wrapper): ``"1"`` or unset keeps it (the default), ``"0"`` leaves the model eager.
COMPILE_ENV = "LORA_PIN_VLLM_COMPILE"


def compiling_asked() -> bool:
    """Whether :data:`COMPILE_ENV` asks for the compiled forward: unset or ``"1"``; ``"0"`` does not.

    Raises:
        ValueError: another value, naming the variable and the value.
    """
    value = os.environ.get(COMPILE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{COMPILE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


#: ``(module, qualified name, what the plugin relies on)`` for every vLLM object it patches or calls.
SEAMS = (
    ("vllm.platforms.cpu", "CpuPlatform.get_punica_wrapper", "classmethod returning a qualified name"),
    (
        "vllm.platforms.cpu",
        "CpuPlatform.check_and_update_config",
        "classmethod (vllm_config); VLLM_COMPILE -> DYNAMO_TRACE_ONCE, then NONE with LoRA",
    ),
    ("vllm.lora.punica_wrapper.punica_cpu", "PunicaWrapperCPU", "the base class of lora_pin's wrapper"),
    ("vllm.lora.model_manager", "LoRAModelManager.activate_adapter", "(self, lora_id) -> bool"),
    ("vllm.lora.model_manager", "LoRAModelManager.lora_index_to_id", "slot -> adapter id list"),
    ("vllm.lora.model_manager", "LoRAModelManager.punica_wrapper_mapping", "prefix -> punica wrapper"),
    ("vllm.lora.model_manager", "LoRAModelManager.modules", "name -> LoRA layer (.lora_a_stacked)"),
    ("vllm.lora.model_manager", "LoRAModelManager._get_lora_layer_weights", "(model, name) -> weights|None"),
    ("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", "-> EngineCoreRequest"),
    ("vllm.v1.engine", "EngineCoreRequest.cache_salt", "str | None, mixed into the first block's hash"),
    ("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys", "keys blocks by cache_salt"),
    ("vllm.v1.core.kv_cache_utils", "_gen_lora_extra_hash_keys", "(request) -> the ('lora', name, path) key"),
    ("vllm.entrypoints.openai.models.serving", "OpenAIServingModels.load_lora_adapter", "async, -> str"),
    ("vllm.v1.engine.core", "EngineCore", "utility calls by method name; .scheduler, .model_executor"),
    ("vllm.v1.worker.worker_base", "WorkerBase", "collective_rpc calls its methods by name"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", "the step; reads self.waiting, self.running"),
    ("vllm.v1.core.sched.request_queue", "FCFSRequestQueue", "a deque of requests"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.max_num_running_reqs", "rotation lowers it for a step"),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.prev_step_scheduled_req_ids",
        "rotation: a running request left out of a step gets its tokens sent again",
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._update_states",
        "rotation: drops unscheduled requests from the persistent batch, keeps their state",
    ),
    ("vllm.entrypoints.openai.models.api_router", "models", "request -> OpenAIServingModels"),
    ("vllm.utils.cache", "LRUCache._unpin", "(key) -> None; LRUCache.pin and .pinned_items beside it"),
    ("vllm.utils.cache", "LRUCache.pinned_items", "the pinned keys"),
    # DoRA (lora_pin.vllm.dora): vLLM's refusal lifted, the magnitudes read, the factors computed at load.
    ("vllm.lora.peft_helper", "PEFTHelper._validate_features", "(self) -> messages; refuses use_dora"),
    ("vllm.lora.lora_model", "parse_fine_tuned_lora_name", "(name, weights_mapper) -> (module, is_lora_a)"),
    (
        "vllm.lora.lora_model",
        "LoRAModel.from_lora_tensors",
        "classmethod (tensors, peft_helper, weights_mapper)",
    ),
    ("vllm.lora.worker_manager", "WorkerLoRAManager._load_adapter", "(self, lora_request) -> LoRAModel"),
    ("vllm.lora.model_manager", "LoRAModelManager.packed_modules", "fused layer -> its modules' names"),
    ("vllm.lora.model_manager", "LoRAModelManager.modules", "layer name -> its LoRA layer"),
    ("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", "(layer, remove_weight) drops it"),
    ("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA.apply", "base(x, bias), add_lora_linear"),
    # --lora-target-modules (lora_pin.vllm.targets): an adapter with weights elsewhere is refused.
    ("vllm.config.lora", "LoRAConfig.target_modules", "module suffixes given buffers, or None"),
    (
        "vllm.lora.utils",
        "is_in_target_modules",
        "(module name, targets, packed mapping) -> whether the module gets buffers",
    ),
    ("vllm.lora.model_manager", "LoRAModelManager.packed_modules_mapping", "fused -> adapter modules"),
    ("vllm.lora.model_manager", "LoRAModelManager._create_lora_modules", "(self): makes self.modules"),
    ("vllm.lora.model_manager", "LoRAModelManager.lora_slots", "the slots (--max-loras)"),
    (
        "vllm.lora.layers.base_linear",
        "BaseLinearLayerWithLoRA.reset_lora",
        "(self, index) zeroes slot index of lora_a_stacked and lora_b_stacked (tuples)",
    ),
    (
        "vllm.lora.layers",
        "VocabParallelEmbeddingWithLoRA.forward",
        "add_lora_embedding(out, x, self.lora_b_stacked): layers known by lora_b_stacked",
    ),
)

_installed = False


def install() -> None:
    """Patches vLLM's seams in this process (a second call does nothing).

    Raises:
        RuntimeError: vLLM is not of minor version :data:`VLLM_MINOR`.
    """
    global _installed
    if _installed:
        return
    import vllm

    if not vllm.__version__.startswith(VLLM_MINOR + "."):
        raise RuntimeError(
            f"lora_pin's vLLM plugin is built for vLLM {VLLM_MINOR}.x, this is vLLM {vllm.__version__}: "
            f"install lora_pin[vllm] to get a matching vLLM, or unset VLLM_PLUGINS to run vLLM without it"
        )
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.platforms import cpu
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.worker_base import WorkerBase

    from lora_pin.vllm import dora, targets
    from lora_pin.vllm.identity import digesting_load, lora_keys_unless_salted, salting_process_inputs
    from lora_pin.vllm.pins import set_pin, worker_set_pin

    cpu.CpuPlatform.get_punica_wrapper = classmethod(lambda cls: PUNICA_WRAPPER)  # type: ignore[method-assign]
    cpu.CpuPlatform.check_and_update_config = classmethod(  # type: ignore[method-assign]
        keeping_compilation(cpu.CpuPlatform.check_and_update_config.__func__)
    )
    LoRAModelManager.activate_adapter = _recording_ranks(LoRAModelManager.activate_adapter)  # type: ignore[method-assign]
    BaseLinearLayerWithLoRA.reset_lora = zeroing_once(BaseLinearLayerWithLoRA.reset_lora)  # type: ignore[method-assign]
    InputProcessor.process_inputs = salting_process_inputs(InputProcessor.process_inputs)  # type: ignore[method-assign]
    OpenAIServingModels.load_lora_adapter = digesting_load(OpenAIServingModels.load_lora_adapter)  # type: ignore[method-assign]
    kv_cache_utils._gen_lora_extra_hash_keys = lora_keys_unless_salted(
        kv_cache_utils._gen_lora_extra_hash_keys
    )
    # New methods, reached by name: the engine core's utility calls and the workers' collective_rpc.
    EngineCore.lora_pin_set_pin = set_pin  # type: ignore[attr-defined]
    WorkerBase.lora_pin_set_pin = worker_set_pin  # type: ignore[attr-defined]
    dora.install()
    targets.install()
    _installed = True


def keeping_compilation(check: Any) -> Any:
    """``CpuPlatform.check_and_update_config`` (the function under its classmethod) that, unless
    :data:`COMPILE_ENV` is ``"0"``, keeps with LoRA the compilation mode it gives without: vLLM 0.32
    turns ``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE`` (one Dynamo trace, inductor) and then sets ``NONE``
    whenever LoRA is on, because its own CPU punica wrapper reads the step's metadata on the host in
    every layer (``no_lora``, ``is_prefill``, the segment counts). lora_pin's wrapper is one opaque op
    per layer under ``torch.compile`` (:mod:`lora_pin.vllm.punica`). Left as vLLM set it: with the
    variable ``"0"``, with ``--fully-sharded-loras`` (whose shrink and expand halves are not made
    traceable) and when compilation was not asked for (``--enforce-eager``, ``-O0``). When it keeps
    compilation, it turns vLLM's compile cache off for the engine's processes
    (``VLLM_DISABLE_COMPILE_CACHE=1``): the cache's key does not cover lora_pin's version. Raises
    ``ValueError`` when the variable is neither ``"0"`` nor ``"1"`` (:func:`compiling_asked`), so that
    vLLM does not start on a misspelt switch."""
    from vllm.logger import init_logger

    log = init_logger("vllm.lora_pin.compile")  # under vLLM's logger: its level and handlers

    @functools.wraps(check)
    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        from vllm.config import CompilationMode

        compilation = vllm_config.compilation_config
        requested = compilation.mode
        check(cls, vllm_config)
        lora = vllm_config.lora_config
        if lora is None or not compiling_asked() or compilation.mode != CompilationMode.NONE:
            return
        if lora.fully_sharded_loras:
            log.info("lora_pin: the model runs eagerly with --fully-sharded-loras (%s ignored)", COMPILE_ENV)
            return
        if requested == CompilationMode.VLLM_COMPILE:
            # What the platform gives this mode without LoRA (its backend settings are made already).
            compilation.mode = CompilationMode.DYNAMO_TRACE_ONCE
        elif requested in (CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE):
            compilation.mode = requested
        else:
            return
        # vLLM's compile cache keys a compiled forward by vLLM's config, environment and the Python files
        # Dynamo traced, not by lora_pin's version or extension: an artifact from another lora_pin (another
        # op schema, another handle numbering) could be loaded as it is. Each start
        # compiles afresh instead (what vLLM's platforms do to set up their workers: the environment the
        # engine's processes inherit).
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        log.info(
            "lora_pin: LoRA with vLLM's compiled forward (compilation mode %s; %s=0 runs it eagerly)",
            compilation.mode.name,
            COMPILE_ENV,
        )

    return check_and_update_config


def zeroing_once(reset: Any) -> Any:
    """``BaseLinearLayerWithLoRA.reset_lora`` (zeroes one slot of a linear layer's LoRA buffers) that
    does nothing when the slot is zero already: this function zeroed it and nothing has been written into
    any of the layer's buffers since (their ``_version`` counters are those it left). vLLM zeroes every
    layer's slot on each activation, the layers the adapter has weights for (before copying them in) and
    the rest (for adapters on q/k/v/o only, the MLP's: most of the bytes); those stay zero, and zeroing
    them again was most of an activation's cost. The buffers' contents are exactly vLLM's."""

    @functools.wraps(reset)
    def reset_lora(self: Any, index: int) -> None:
        state = self.__dict__.get("_lora_pin_zeroed")
        zeroed: set[int] = set()
        if state is not None and _unwritten(self, *state[:2]):
            zeroed = state[2]
            if index in zeroed:
                return
        reset(self, index)
        zeroed.add(index)
        buffers = _buffers(self)
        self.__dict__["_lora_pin_zeroed"] = (buffers, [t._version for t in buffers], zeroed)

    return reset_lora


def _buffers(layer: Any) -> tuple[Any, ...]:
    return (*layer.lora_a_stacked, *layer.lora_b_stacked)


def _unwritten(layer: Any, buffers: tuple[Any, ...], versions: list[int]) -> bool:
    """Whether ``layer``'s LoRA buffers are still ``buffers`` and nothing was written into them since
    their ``_version`` counters were ``versions`` (every in-place write bumps its tensor's; views share
    their base's)."""
    now = _buffers(layer)
    return len(now) == len(buffers) and all(
        t is old and t._version == version for t, old, version in zip(now, buffers, versions, strict=True)
    )


def adapter_rank(lora_model: Any) -> int:
    """The largest rank over an adapter's modules (``rank_pattern`` gives modules their own): the columns
    of its slot that hold anything."""
    ranks = [int(weights.rank) for weights in lora_model.loras.values()]
    return max(ranks, default=int(lora_model.rank))


def _recording_ranks(activate: Any) -> Any:
    """``activate_adapter`` that also tells lora_pin's punica wrappers the rank of the adapter it put in
    a slot and the layers (linear, token embedding) it has no weights for (vLLM zeroes the slot there:
    ``reset_lora``), gives its DoRA factors to the slot's layers, and pins it there if it is pinned."""
    from lora_pin.vllm.dora import activate as activate_dora
    from lora_pin.vllm.pins import pin_on_activation
    from lora_pin.vllm.punica import LoraPinPunicaWrapper, keyed_buffer

    @functools.wraps(activate)
    def activate_adapter(self: Any, lora_id: int) -> bool:
        activated = activate(self, lora_id)
        if activated:
            slot = self.lora_index_to_id.index(lora_id)
            lora_model = self._registered_adapters[lora_id]
            rank = adapter_rank(lora_model)
            without = [
                buffer
                for name, module in self.modules.items()
                if (buffer := keyed_buffer(module)) is not None
                and not self._get_lora_layer_weights(lora_model, name)
            ]
            for wrapper in self.punica_wrapper_mapping.values():
                if isinstance(wrapper, LoraPinPunicaWrapper):
                    wrapper.set_slot(slot, len(self.lora_index_to_id), rank, without)
            activate_dora(self, slot, lora_model)
            pin_on_activation(self, lora_id)
        return bool(activated)

    return activate_adapter
