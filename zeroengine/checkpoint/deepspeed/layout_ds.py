"""DeepSpeed 0.19's data-parallel layout of ZeRO state: pure partition maths, no tensors moved.

What ``ze_to_deepspeed`` must reproduce exactly, because DeepSpeed's loaders copy
flat partitions without looking at names (DeepSpeed 0.19.8, with its defaults
``round_robin_gradients=false`` and ``parameter_alignment=false``):

* stages 1 and 2 (``runtime/zero/stage_1_and_2.py``): each optimizer param group
  is one flat buffer, its trainable parameters back to back in the group's order,
  padded at the end to a multiple of ``2 * world`` elements (the "nccl start
  alignment" of 2 elements, whatever the dtype, times the world) and cut into
  ``world`` equal partitions; rank r's file holds partition r (its fp32 values
  without the trailing padding, its optimizer moments with it) and, per parameter
  overlapping it, where that parameter's slice lies in the partition;
* stage 3 (``runtime/zero/stage3.py`` and ``partition_parameters.py``): every
  parameter is cut on its own into ``world`` pieces of ``ceil(numel / world)``
  elements (the last ones zero-padded); a param group's parameters form sub-groups
  of at most ``sub_group_size`` partition elements, and rank r's flat buffer for a
  sub-group is its pieces of those parameters back to back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

NCCL_START_ALIGNMENT_FACTOR = 2  # elements: DeepSpeed aligns partition starts to 4 bytes of fp16 on any dtype
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size's default


@dataclass(frozen=True)
class Fragment:
    """Elements [param_start, param_start + numel) of parameter ``index`` (its place in the group) lie at
    ``flat_start`` of a rank's flat partition."""

    index: int
    param_start: int
    numel: int
    flat_start: int


@dataclass(frozen=True)
class FlatPartition:
    """Rank ``rank``'s partition of one stage 1/2 flat group: ``size`` elements, the last ``padding`` of them
    past the group's real elements (DeepSpeed's ``group_paddings`` entry), and the fragments in it."""

    rank: int
    size: int
    padding: int
    fragments: tuple[Fragment, ...]


def flat_group_partitions(numels: Sequence[int], world: int) -> list[FlatPartition]:
    """Every rank's partition of a stage 1/2 flat group of parameters of sizes ``numels``, in order."""
    total = sum(numels)
    alignment = NCCL_START_ALIGNMENT_FACTOR * world
    padded = -(-total // alignment) * alignment
    size = padded // world
    offsets, offset = [], 0
    for n in numels:
        offsets.append(offset)
        offset += n
    partitions = []
    for rank in range(world):
        lo, hi = rank * size, (rank + 1) * size
        fragments = []
        for index, (start, n) in enumerate(zip(offsets, numels)):
            # DeepSpeed's overlap test (_init_lp_to_hp_mapping); empty parameters get no fragment
            if n > 0 and (lo <= start < hi or start < lo < start + n):
                first = max(start, lo)
                fragments.append(Fragment(index, first - start, min(start + n, hi) - first, first - lo))
        padding = size if total <= lo else (hi - total if total < hi else 0)
        partitions.append(FlatPartition(rank, size, padding, tuple(fragments)))
    return partitions


def stage3_partition_numel(numel: int, world: int) -> int:
    """Elements of one rank's piece of a stage 3 parameter (padding included)."""
    return -(-numel // world)


def stage3_piece(numel: int, world: int, rank: int) -> tuple[int, int]:
    """(start, real elements) of ``rank``'s piece of a stage 3 parameter; the rest of the piece is padding."""
    size = stage3_partition_numel(numel, world)
    start = rank * size
    return start, max(0, min(size, numel - start))


def stage3_sub_groups(numels: Sequence[int], world: int,
                      sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> list[list[int]]:
    """One param group's parameters (indices into ``numels``) split into DeepSpeed's stage 3 sub-groups: closed
    once their pieces reach ``sub_group_size`` elements, or at the group's last parameter."""
    sizes = [stage3_partition_numel(n, world) for n in numels]
    if sub_group_size is None or sub_group_size >= sum(sizes):
        return [list(range(len(numels)))]
    groups, current, filled = [], [], 0
    for index, size in enumerate(sizes):
        current.append(index)
        filled += size
        if filled >= sub_group_size or index == len(sizes) - 1:
            groups.append(current)
            current, filled = [], 0
    return groups
