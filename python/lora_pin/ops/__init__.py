"""Multi-adapter LoRA GEMM as torch custom ops: ``torch.ops.lora_pin.shrink`` and ``.expand``.

Every token of a batch may use a different adapter (or none). The ops are driven by one
:class:`KernelMeta`: a step's segment arrays (made by the Rust planner or :func:`segments_from_slots`)
joined with a layer group's per-slot ranks, scalings and slice layout (:meth:`KernelMeta.for_layer`);
they read the adapters from the device pool's stacked ``A`` / ``B`` buffers. CUDA tensors run Triton SGMV
kernels (CUDA-graph capturable: no host-device synchronisation); CPU tensors run grouped torch GEMMs
and the native kernels. Every op is registered from one table (:mod:`lora_pin.ops.library`).
LoRA on MoE experts (:mod:`lora_pin.ops.experts`) runs the same two ops over ``(adapter, expert)``
segments; an embedding's LoRA (a lookup, then expand) runs ``lora_pin::embedding_delta_``
(:mod:`lora_pin.ops.embedding`). A pool in rank pages (:mod:`lora_pin.ops.paged`) runs
``lora_pin::paged_shrink`` / ``paged_expand`` (:mod:`lora_pin.ops.paged_ops`). A DoRA adapter's rows
are the LoRA rows rescaled afterwards by ``lora_pin::dora_scale_`` (:mod:`lora_pin.ops.dora`). The
model's LoRA layers run their work through a backend chosen once per device
(:mod:`lora_pin.ops.backends`). The Triton kernels also run on CPU tensors under the Triton interpreter
through :mod:`lora_pin.ops.triton_sgmv` (tests).
"""

from lora_pin.ops import library as _library  # noqa: F401  (registers torch.ops.lora_pin.*)
from lora_pin.ops._checks import OpArgumentError
from lora_pin.ops.custom_ops import expand, lora_delta_, shrink
from lora_pin.ops.dora import dora_scale_, dora_scale_reference
from lora_pin.ops.embedding import embedding_delta_
from lora_pin.ops.experts import (
    ExpertMeta,
    expert_lora_delta_,
    expert_reference,
    expert_segments,
    flat_expert_buffers,
)
from lora_pin.ops.paged import PageTable
from lora_pin.ops.paged_ops import paged_expand, paged_shrink
from lora_pin.ops.reference import expand_reference, lora_reference, shrink_reference
from lora_pin.ops.segments import CUDA_CHUNK_SIZE, KernelMeta, segments_from_slots

__all__ = [
    "CUDA_CHUNK_SIZE",
    "ExpertMeta",
    "KernelMeta",
    "OpArgumentError",
    "PageTable",
    "dora_scale_",
    "dora_scale_reference",
    "embedding_delta_",
    "expand",
    "expand_reference",
    "expert_lora_delta_",
    "expert_reference",
    "expert_segments",
    "flat_expert_buffers",
    "lora_delta_",
    "lora_reference",
    "paged_expand",
    "paged_shrink",
    "segments_from_slots",
    "shrink",
    "shrink_reference",
]
