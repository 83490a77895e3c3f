"""Where expert parameters go in a checkpoint: under their global expert id, so a checkpoint reshards over
any ``ep_size`` that divides ``num_experts``. Above the layer modules (it walks a model's :class:`MoE`
layers); :mod:`.params` below them only tags parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroengine.zero.param_guard import full_shape

from .autoep.experts import ShardedExperts
from .grouped import GroupedMLPExperts
from .layer import MoE


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
    AutoEP's experts (:class:`~zeroengine.moe.autoep.ShardedExperts`) are stored the same way under the
    model's own names (``...mlp.experts.gate_up_proj`` shaped ``[num_experts, 2I, H]``), so a checkpoint
    consolidates into a state_dict of the unconverted model. Either way a checkpoint reshards over any
    ``ep_size`` that divides ``num_experts``. Dense parameters are not listed.
    """
    present = dict(module.named_parameters())
    places: dict[str, StoredAs] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, ShardedExperts):  # AutoEP: the model's own stacked names and full shapes
            for rest, p in sub.named_parameters(recurse=False):
                name = f"{prefix}.{rest}" if prefix else rest
                if present.get(name) is p:
                    shape = full_shape(p)  # (stage 3: the parameter itself may be partitioned, empty)
                    places[name] = StoredAs(name, sub.first * math.prod(shape[1:]), (sub.num_experts, *shape[1:]))
            continue
        if not isinstance(sub, MoE):
            continue
        head = f"{prefix}.local_experts" if prefix else "local_experts"
        if isinstance(sub.local_experts, GroupedMLPExperts):
            first = sub.global_expert_ids[0]
            for rest, p in sub.local_experts.named_parameters():
                if present.get(f"{head}.{rest}") is p:
                    shape = full_shape(p)  # (stage 3: the parameter itself may be partitioned, empty)
                    per_expert = math.prod(shape[1:]) if shape[0] else 0
                    places[f"{head}.{rest}"] = StoredAs(f"{head}.{rest}", first * per_expert,
                                                        (sub.num_experts, *shape[1:]))
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
