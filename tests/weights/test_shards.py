"""Shard plans: one process's plan (:data:`~lora_pin.weights.shards.WHOLE`) holds every tensor whole, and a
plan that cuts a group gives that group's shapes and ranges from its cut and every other group's whole.

Oracles: the model's own widths (the targets) and the tensors PEFT saved (read back with safetensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_pin.errors import SpecError
from lora_pin.fixtures import make_peft_adapter
from lora_pin.weights import LoRATargets, TargetGroup, load_adapter
from lora_pin.weights.shards import WHOLE, MemberShard, ShardPlan

PREFIX = "base_model.model."


@dataclass(frozen=True)
class HalfRows:
    """A stand-in cut: the first half of a one-member group's output rows (a column-parallel rank 0 of 2)."""

    members: tuple[MemberShard, ...]
    inputs_cut: bool = False

    def pool_shape(self, group: TargetGroup, max_rank: int) -> tuple[int, int, int]:
        return max_rank, group.out_total, max_rank

    def host_shape(self, group: TargetGroup, rank: int, max_rank: int) -> tuple[int, int, int]:
        return rank, group.out_total, rank

    def b_offsets(self, group: TargetGroup) -> tuple[int, ...]:
        return group.slice_offsets


def test_the_whole_plan_cuts_nothing(tiny_llama: torch.nn.Module) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    for group in targets.groups:
        assert WHOLE.group(group.key) is None
        assert WHOLE.host_shape(group, 3) == (3, group.out_total, 3)
        assert WHOLE.pool_shape(group, 8) == (8, group.out_total, 8)
        assert WHOLE.b_offsets(group) == group.slice_offsets
        assert WHOLE.whole_widths(group) == (group.in_features, group.out_total)
        assert not WHOLE.cuts_rank(group) and not WHOLE.inputs_cut(group.key)
        for member in group.members:
            shard = WHOLE.member(member)
            assert shard.is_whole
            assert (shard.full_in, shard.full_out) == (member.in_features, member.out_features)
            assert shard.a_rows(5, 0) == (0, 5)
    assert not WHOLE.parallel and not WHOLE.fully_sharded


def test_a_plan_gives_a_cut_groups_ranges_and_holds_the_others_whole(tiny_llama: torch.nn.Module) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    down = next(g for g in targets.groups if g.key.endswith("layers.0.mlp.down_proj"))
    member = down.members[0]
    # Unsharded the layer is twice as wide as this rank's part.
    half = MemberShard(
        member.in_features, 2 * member.out_features, (0, member.in_features), (0, member.out_features)
    )
    plan = ShardPlan({down.key: (down, HalfRows((half,)))}, parallel=True, ranks=2)
    assert plan.member(member) == half and not half.is_whole
    assert plan.whole_widths(down) == (down.in_features, 2 * down.out_total)
    other = next(g for g in targets.groups if g.key != down.key)
    assert plan.member(other.members[0]) == MemberShard.whole(other.members[0])
    assert plan.whole_widths(other) == (other.in_features, other.out_total)


def test_a_fully_sharded_plan_needs_the_pool_rank() -> None:
    with pytest.raises(SpecError, match="max_rank"):
        ShardPlan(parallel=True, ranks=2, fully_sharded=True)
    assert ShardPlan(parallel=True, ranks=2, fully_sharded=True, max_rank=9).rank_chunk == 5


def test_a_plan_over_ranks_that_cuts_nothing_reads_what_one_process_reads(
    tiny_llama: torch.nn.Module, tmp_path: Path
) -> None:
    targets = LoRATargets.from_model(tiny_llama)
    path = make_peft_adapter(
        tiny_llama, tmp_path / "a", r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"]
    )
    saved = load_file(path / "adapter_model.safetensors")
    whole = load_adapter("a", path, targets, max_rank=8, dtype=torch.float32)
    uncut = load_adapter("a", path, targets, max_rank=8, dtype=torch.float32, shards=ShardPlan(parallel=True))
    assert whole.modules.keys() == uncut.modules.keys() and whole.modules
    for key, module in whole.modules.items():
        other = uncut.modules[key]
        assert torch.equal(module.a, other.a) and torch.equal(module.b, other.b)
        assert torch.equal(module.a, saved[f"{PREFIX}{key}.lora_A.weight"])
        assert torch.equal(module.b, saved[f"{PREFIX}{key}.lora_B.weight"])
    assert (whole.digest, whole.whole_nbytes) == (uncut.digest, uncut.whole_nbytes)
    assert whole.whole_nbytes == whole.nbytes
