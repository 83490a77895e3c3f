"""Every rank starts from rank 0's weights (DeepSpeed's and DDP's rule).

Ranks that built their model with different seeds, or a script that edited a
parameter on rank 0 only before ``initialize()``, would otherwise train
different models (stage 0 forever, stages 1-2 until the first step takes each
shard owner's value). Parameters and buffers are broadcast from rank 0, in a
few bucketed collectives, before the ZeRO stage copies them into its buffers.
Expert parameters (and the buffers of modules that hold them) differ by design
between expert-parallel ranks: each comes from the first rank of its
expert-data-parallel group instead. Parameters already partitioned by
``zero.Init`` are skipped: Init makes them identical on every rank by
construction.
"""
from __future__ import annotations

import torch

from zeroengine import comm
from zeroengine.comm.bucketing import broadcast_in_buckets

from .init import is_init_partitioned


def broadcast_initial_state(module: torch.nn.Module, mesh=None) -> None:
    """Over ``mesh``'s data × sequence group (the world by default): the ranks holding other pipeline stages or
    tensor slices hold other parameters."""
    if comm.get_world_size() == 1 or (mesh is not None and mesh.zero_size == 1):
        return
    data = (0, None) if mesh is None or mesh.zero_group is None else (mesh.zero_ranks[0], mesh.zero_group)
    by_source: dict[tuple, list[torch.Tensor]] = {}
    for sub in module.modules():
        params = [p for p in sub.parameters(recurse=False) if not is_init_partitioned(p)]
        source = _source_of(params, data)
        by_source.setdefault(source, []).extend(p.data for p in params)
        by_source.setdefault(source, []).extend(b for b in sub.buffers(recurse=False) if b is not None)
    # The world broadcast first on every rank; expert groups are disjoint, so their order cannot deadlock.
    for (src, group), tensors in sorted(by_source.items(), key=lambda kv: (kv[0][1] is not None, kv[0][0])):
        unique = list({t.data_ptr(): t for t in tensors if t.numel() > 0}.values())  # tied weights once
        broadcast_in_buckets(unique, src=src, group=group)


def _source_of(params: list[torch.Tensor], data: tuple) -> tuple:
    """(global source rank, group) for one module's tensors: the first of the data-parallel group ``data``, or of
    an expert group."""
    from zeroengine.moe.params import expert_groups_of, is_expert_param

    for p in params:
        if is_expert_param(p):
            groups = expert_groups_of(p)
            return groups.edp_ranks[0], groups.edp_group
    return data
