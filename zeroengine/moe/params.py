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


@dataclass(frozen=True)
class StoredAs:
    """Where a parameter's flat values go in a checkpoint: elements ``[offset, offset + numel)`` of the
    stored tensor ``name``, whose shape is ``shape`` (None: the parameter's own shape, offset 0)."""

    name: str
    offset: int = 0
    shape: tuple[int, ...] | None = None


def expert_checkpoint_places(module: torch.nn.Module) -> dict[str, StoredAs]:
    """``{local name: StoredAs}`` for every expert parameter of ``module``.

    The local name is the one ``module.named_parameters()`` gives
    (``...moe.local_experts.<local index>.<rest>``); it is stored under the name
    with the local index replaced by the global expert id. Stacked experts
    (:class:`~zeroengine.moe.grouped.GroupedMLPExperts`) hold experts ``a .. b`` in
    one ``[count, ...]`` parameter ``...local_experts.w1``: stored as elements
    ``a * per_expert ..`` of ``...local_experts.w1`` shaped ``[num_experts, ...]``.
    Either way a checkpoint reshards over any ``ep_size`` that divides
    ``num_experts``. Dense parameters are not listed.
    """
    from .grouped import GroupedMLPExperts
    from .layer import MoE

    present = dict(module.named_parameters())
    places: dict[str, StoredAs] = {}
    for prefix, sub in module.named_modules():
        if not isinstance(sub, MoE):
            continue
        head = f"{prefix}.local_experts" if prefix else "local_experts"
        if isinstance(sub.local_experts, GroupedMLPExperts):
            first = sub.global_expert_ids[0]
            for rest, p in sub.local_experts.named_parameters():
                if present.get(f"{head}.{rest}") is p:
                    per_expert = p[0].numel() if p.shape[0] else 0
                    places[f"{head}.{rest}"] = StoredAs(f"{head}.{rest}", first * per_expert,
                                                        (sub.num_experts, *p.shape[1:]))
            continue
        for local, (gid, expert) in enumerate(zip(sub.global_expert_ids, sub.local_experts)):
            for rest, p in expert.named_parameters():
                local_name = f"{head}.{local}.{rest}"
                if present.get(local_name) is p:
                    places[local_name] = StoredAs(f"{head}.{gid}.{rest}")
    return places


def expert_checkpoint_names(module: torch.nn.Module) -> dict[str, str]:
    """``{local name: stored name}`` for every expert parameter (see :func:`expert_checkpoint_places`;
    a stacked parameter's stored name is shared by the ranks, each holding its own range of it)."""
    return {local: place.name for local, place in expert_checkpoint_places(module).items()}
