"""The experts one rank holds, and running them over expert-contiguous token batches."""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from .params import tag_expert_params


def make_local_experts(expert: nn.Module, global_ids: Sequence[int], ep_size: int) -> nn.ModuleList:
    """One deep copy of ``expert`` per global id, its parameters tagged as expert parameters."""
    experts = nn.ModuleList(copy.deepcopy(expert) for _ in global_ids)
    for gid, e in zip(global_ids, experts):
        tag_expert_params(e, ep_size, gid)
    return experts


def init_experts(experts: nn.ModuleList, global_ids: Sequence[int], init_fn: Callable[[nn.Module], None],
                 seed: int) -> None:
    """Run ``init_fn(expert)`` under the CPU RNG seeded with ``seed + global id``.

    Expert ``g`` then gets the same initial weights whichever rank holds it and
    whatever ``ep_size`` is, and initialising experts leaves the global RNG (and
    so every dense parameter initialised after) untouched. Initialise on CPU.
    """
    for gid, expert in zip(global_ids, experts):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + gid)
            init_fn(expert)


def run_experts(experts: nn.ModuleList, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``x`` holds ``counts[i]`` consecutive rows for expert i; returns their outputs in the same order.

    Every expert runs, even on zero rows, so every expert parameter gets a
    gradient (zeros) each step and gradient hooks fire identically on all ranks.
    """
    if len(experts) == 1:  # one expert per rank (ep_size == num_experts): no split / concatenate copies
        return experts[0](x)
    chunks = x.split(list(counts))
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])
