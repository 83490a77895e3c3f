"""Mixture of Experts: top-k gates, expert parallelism over all-to-all, fused token permutation.

Public: :class:`MoE` (DeepSpeed's signature), :class:`TopKGate` and :class:`GateOutput` (for
custom routers), the process groups (:func:`expert_groups`), and what ZeRO and
checkpoints need about expert parameters (:func:`is_expert_param`,
:func:`expert_data_parallel_group`, :func:`expert_checkpoint_places`).
See docs/moe.md.
"""
from .checkpoint_places import StoredAs, expert_checkpoint_names, expert_checkpoint_places
from .gate import TopKGate
from .groups import ExpertGroups, expert_groups
from .layer import MoE
from .params import (
    ExpertTag,
    expert_data_parallel_group,
    expert_groups_of,
    expert_tag,
    is_expert_param,
)
from .routing import GateOutput, capacity_for, load_balancing_loss, router_z_loss

__all__ = ["ExpertGroups", "ExpertTag", "GateOutput", "MoE", "StoredAs", "TopKGate", "capacity_for",
           "expert_checkpoint_names", "expert_checkpoint_places",
           "expert_data_parallel_group", "expert_groups", "expert_groups_of", "expert_tag", "is_expert_param",
           "load_balancing_loss", "router_z_loss"]
