"""The experts one rank holds, and running them over expert-contiguous token batches.

Two layouts (``MoE(expert_layout=...)``): ``"modules"``, one deep copy of the expert per
local expert in an :class:`ExpertList` (any ``nn.Module``); ``"stacked"``, a
:class:`~zeroengine.moe.grouped.GroupedMLPExperts` (standard-MLP experts only, weights
stacked into ``[E_local, ...]`` parameters). Standard-MLP experts run as grouped GEMMs
in either layout unless ``grouped="off"`` (see :mod:`zeroengine.moe.grouped`).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from .expert_group import SERIAL_BELOW, call_expert
from .grouped import GroupedMLPExperts, RowExperts, grouped_mlp_modules, has_hooks, mlp_spec
from .grouped_cpu import GradWorkspace
from .params import tag_expert_params

LAYOUTS = ("modules", "stacked")
GROUPED = ("auto", "on", "off")


class ExpertList(nn.ModuleList):
    """Per-expert modules (a ``ModuleList``: parameter names ``<i>.<rest>`` as before) and how to run them:
    ``grouped`` is ``"auto"`` / ``"on"`` / ``"off"``, ``spec`` the MLP spec when the experts are standard MLPs.
    ``serial_below``: experts run one module at a time whose mean batch holds fewer elements run with one
    intra-op thread (for oversubscribed hosts; see :mod:`zeroengine.moe.expert_group`; 0, the default: never)."""

    def __init__(self, modules, grouped: str = "auto"):
        super().__init__(modules)
        self.grouped = grouped
        self.spec = mlp_spec(self[0]) if len(self) else None
        self.grad_workspace = GradWorkspace()  # CPU grouped path (see grouped_cpu.py)
        self.serial_below = SERIAL_BELOW
        if grouped == "on" and self.spec is None:
            raise ValueError('grouped="on" needs an nn.Sequential(nn.Linear, activation, nn.Linear) expert')

    def use_grouped(self) -> bool:
        # Hooks added after construction (e.g. by a profiler) need the modules' own forward.
        return (self.grouped != "off" and len(self) > 1 and self.spec is not None
                and not any(has_hooks(e) for e in self))


def make_local_experts(expert: nn.Module, global_ids: Sequence[int], ep_size: int, layout: str = "modules",
                       grouped: str = "auto") -> nn.Module:
    """The local experts: an :class:`ExpertList` of deep copies of ``expert`` (its parameters tagged
    one expert each), or one :class:`GroupedMLPExperts` (``layout="stacked"``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"expert_layout must be one of {LAYOUTS}, got {layout!r}")
    if grouped not in GROUPED:
        raise ValueError(f"grouped must be one of {GROUPED}, got {grouped!r}")
    if layout == "stacked":
        if grouped == "off":
            raise ValueError('expert_layout="stacked" always runs grouped GEMMs (grouped="off" needs "modules")')
        return GroupedMLPExperts(expert, global_ids, ep_size)
    experts = ExpertList((copy.deepcopy(expert) for _ in global_ids), grouped)
    for gid, e in zip(global_ids, experts):
        tag_expert_params(e, ep_size, gid)
    return experts


def init_experts(experts: nn.Module, global_ids: Sequence[int], init_fn: Callable[[nn.Module], None],
                 seed: int) -> None:
    """Run ``init_fn(expert)`` under the CPU RNG seeded with ``seed + global id``.

    Expert ``g`` then gets the same initial weights whichever rank holds it, whatever
    ``ep_size`` is and in either layout (stacked experts run ``init_fn`` on a standalone
    copy of each expert and take its weights), and initialising experts leaves the global
    RNG (and so every dense parameter initialised after) untouched. Initialise on CPU.
    """
    for i, gid in enumerate(global_ids):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + gid)
            if isinstance(experts, GroupedMLPExperts):
                module = experts.expert_module(i)
                init_fn(module)
                experts.load_expert(i, module)
            else:
                init_fn(experts[i])


def runs_per_module(experts: nn.Module) -> bool:
    """Whether :func:`run_experts` would call each of several experts on its own slice (not grouped GEMMs)."""
    if isinstance(experts, RowExperts) or len(experts) < 2:
        return False
    return not (isinstance(experts, ExpertList) and experts.use_grouped())


def run_experts(experts: nn.Module, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``x`` holds ``counts[i]`` consecutive rows for expert i; returns their outputs in the same order.

    Every expert runs, even on zero rows, so every expert parameter gets a
    gradient (zeros) each step and gradient hooks fire identically on all ranks.
    """
    if isinstance(experts, RowExperts):
        return experts.run_rows(x, counts)
    if isinstance(experts, ExpertList) and experts.use_grouped():
        return grouped_mlp_modules(experts, x, counts, experts.spec, experts.grad_workspace)
    if len(experts) == 1:  # one expert per rank (ep_size == num_experts): no split / concatenate copies
        return call_expert(experts[0], x)
    chunks = x.split(list(counts))
    return torch.cat([call_expert(expert, chunk) for expert, chunk in zip(experts, chunks)])
