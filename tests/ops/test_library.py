"""The table of ``lora_pin::`` ops (:mod:`lora_pin.ops.library`): each registered as the table writes it,
and its bodies gather the schema's segment fields into the one meta they take."""

from __future__ import annotations

import pytest
import torch

from lora_pin.ops import KernelMeta
from lora_pin.ops.library import EXPAND_META, OPS, SHRINK_META, OpSpec


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_every_op_of_the_table_is_registered_as_written(op: OpSpec) -> None:
    overload = getattr(torch.ops.lora_pin, op.name).default
    assert overload._schema == torch._C.parse_schema(f"lora_pin::{op.name}{op.schema}")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has(overload.name(), "CompositeExplicitAutograd")  # the default body, on every device
    assert has(overload.name(), "Meta")  # the fake body
    assert has(overload.name(), "CUDA") == (op.cuda is not None)


def test_a_body_receives_the_schemas_fields_as_one_meta() -> None:
    seen: list[tuple[object, ...]] = []
    spec = OpSpec(
        "unregistered",
        "Tensor(a!) out, Tensor v",
        "()",
        lambda *args: seen.append(args),
        lambda *args: None,
        meta=EXPAND_META,
        after="float scale=1.0",
    )
    out, v, perm, indptr, slots, ranks, scalings = (torch.zeros(1) for _ in range(7))
    spec.body(spec.default)(out, v, perm, indptr, slots, ranks, scalings, [0, 2, 5], 0.5)
    (got,) = seen
    assert got[:2] == (out, v) and got[3] == 0.5
    assert got[2] == KernelMeta(perm, indptr, slots, ranks, 2, scalings, (0, 2, 5))
    assert spec.schema == (
        "(Tensor(a!) out, Tensor v, Tensor perm, Tensor seg_indptr, Tensor seg_slots, Tensor slot_ranks, "
        "Tensor slot_scalings, int[] slice_offsets, float scale=1.0) -> ()"
    )
    shrink = OpSpec(
        "unregistered", "Tensor x", "Tensor", lambda *args: args, lambda *args: None, meta=SHRINK_META
    )
    x = torch.zeros(1)
    assert shrink.body(shrink.default)(x, perm, indptr, slots, ranks, 3) == (
        x,
        KernelMeta(perm, indptr, slots, ranks, 3),
    )
