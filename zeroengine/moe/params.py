"""Expert parameters: the one tag they carry, and names that are unique across ranks.

Every parameter of a local expert carries one attribute, ``ze_moe_expert``, an
:class:`ExpertTag` (its ``ep_size`` and global expert id). ZeRO reads it to
reduce and partition the parameter within its expert-data-parallel group;
checkpoints read it (through :func:`expert_checkpoint_places`) to store the
parameter under its global identity: on every EP rank the experts are
``local_experts.0 ...``, so local names collide, global ones do not. A stacked
``[count, ...]`` parameter (experts ``a .. a+count-1``) is stored as its range of
the ``[num_experts, ...]`` tensor every rank's stacks make together, so it too
reshards over any ``ep_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .groups import ExpertGroups, expert_groups

TAG = "ze_moe_expert"


@dataclass(frozen=True)
class ExpertTag:
    ep_size: int
    expert_id: int  # global id among all num_experts (of a stacked parameter: its first expert)
    count: int = 1  # experts the parameter holds: > 1 for a stacked [count, ...] parameter


def tag_expert_params(expert: torch.nn.Module, ep_size: int, expert_id: int) -> None:
    for p in expert.parameters():
        setattr(p, TAG, ExpertTag(ep_size, expert_id))


def tag_stacked_expert_params(experts: torch.nn.Module, ep_size: int, first_id: int, count: int) -> None:
    """Tag the ``[count, ...]`` parameters of stacked experts (experts ``first_id .. first_id + count - 1``)."""
    for p in experts.parameters():
        setattr(p, TAG, ExpertTag(ep_size, first_id, count))


def expert_tag(p: torch.Tensor) -> ExpertTag | None:
    return getattr(p, TAG, None)


def is_expert_param(p: torch.Tensor) -> bool:
    """True for a parameter of an MoE layer's local expert (not the gate, not the residual MLP)."""
    return expert_tag(p) is not None


def expert_groups_of(p: torch.Tensor) -> ExpertGroups:
    """The EP/EDP groups of an expert parameter (``.edp_group`` reduces its gradient)."""
    tag = expert_tag(p)
    if tag is None:
        raise ValueError("not an expert parameter")
    return expert_groups(tag.ep_size)


def expert_data_parallel_group(p: torch.Tensor):
    """The process group over which ``p``'s gradient is averaged and its ZeRO shards are spread."""
    return expert_groups_of(p).edp_group
