"""Expert-parallel and expert-data-parallel process groups, created once per ``ep_size``.

With a world of W ranks and ``ep_size`` E (E divides W):

* an *expert-parallel* (EP) group is E consecutive ranks ``[i*E, (i+1)*E)``;
  together they hold every expert once, and tokens travel between them by
  all-to-all;
* an *expert-data-parallel* (EDP) group is the W/E ranks ``{j, j+E, j+2E, ...}``
  holding the same experts; expert gradients are reduced, and ZeRO
  partitions expert parameters, within it.

Consecutive EP ranks keep the token all-to-all inside a node when ranks are
numbered node by node (as the launcher numbers them). Groups are created the
first time an ``ep_size`` is asked for, on every rank in the same order (the
layer constructor is collective for that reason), and reused afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zeroengine import comm
from zeroengine.comm.groups import WorldScoped, new_group


@dataclass(frozen=True)
class ExpertGroups:
    ep_size: int
    world_size: int
    ep_group: object | None  # None only in a world of one (no torch.distributed)
    edp_group: object | None
    ep_ranks: tuple[int, ...]  # world ranks of this rank's EP group, in EP-rank order
    edp_ranks: tuple[int, ...]

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(comm.get_rank())

    @property
    def edp_rank(self) -> int:
        return self.edp_ranks.index(comm.get_rank())

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)


_CACHE = WorldScoped()  # (ep_size, world) -> this world's expert groups


def expert_groups(ep_size: int) -> ExpertGroups:
    """This rank's EP and EDP groups for ``ep_size`` (created on first use; collective then)."""
    world = comm.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide the world size ({world})")
    key = (ep_size, world)
    cached = _CACHE.current().get(key)
    if cached is not None:
        return cached
    if not dist.is_initialized():
        groups = ExpertGroups(1, 1, None, None, (0,), (0,))
    else:
        rank = comm.get_rank()
        mine_ep = mine_edp = None
        # Every rank creates every group, in the same order (torch.distributed's rule).
        for first in range(0, world, ep_size):
            ranks = tuple(range(first, first + ep_size))
            group = new_group(list(ranks))
            if rank in ranks:
                mine_ep = (group, ranks)
        for offset in range(ep_size):
            ranks = tuple(range(offset, world, ep_size))
            group = new_group(list(ranks))
            if rank in ranks:
                mine_edp = (group, ranks)
        groups = ExpertGroups(ep_size, world, mine_ep[0], mine_edp[0], mine_ep[1], mine_edp[1])
    _CACHE.current()[key] = groups
    return groups
