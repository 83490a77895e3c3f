"""Megatron-DeepSpeed's Ulysses layer (DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``): any local
attention module made sequence parallel by one all-to-all on each of q, k and v and one on its output.

Layouts are named by dimension: ``[seq/sp, batch, heads, dim]`` (``batch_dim_idx=1``: Megatron's sequence-first)
or ``[batch, seq/sp, heads, dim]`` (``batch_dim_idx=0``). ``scatter_idx`` is the heads' dimension: it is cut
into sp blocks, one per rank, while the sequence pieces the ranks send back are joined along the sequence
dimension; the output goes the other way.
"""
from __future__ import annotations

import torch

from zeroengine import comm

from .all_to_all import dim_zero_all_to_all


def seq_all_to_all(x: torch.Tensor, scatter_idx: int, gather_idx: int, group) -> torch.Tensor:
    """Cut ``x`` along ``scatter_idx`` into one block per rank of ``group``, exchange, and join what arrives
    along ``gather_idx`` in rank order (differentiable)."""
    world = comm.get_world_size(group)
    if x.shape[scatter_idx] % world:
        raise ValueError(f"sequence parallelism: dimension {scatter_idx} of size {x.shape[scatter_idx]} does not "
                         f"divide among {world} ranks")
    received = dim_zero_all_to_all(torch.stack(x.chunk(world, dim=scatter_idx)), group)
    return torch.cat(received.unbind(0), dim=gather_idx)


class DistributedAttention(torch.nn.Module):
    def __init__(self, local_attention: torch.nn.Module, sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream=None) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream  # (DeepSpeed overlaps communication on it; here collectives run in order)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int = 1,
                rotary_pos_emb=None, *args, **kwargs) -> torch.Tensor:
        if rotary_pos_emb is not None:
            raise ValueError("DistributedAttention(rotary_pos_emb=...) is not supported: apply the rotary embedding "
                             "to q and k before (their positions are this rank's piece of the sequence)")
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([batch, seq, heads, dim]) or 1 "
                             f"([seq, batch, heads, dim]), got {batch_dim_idx}")
        seq = self.gather_idx if batch_dim_idx == 1 else 1
        q, k, v = (seq_all_to_all(t, self.scatter_idx, seq, self.spg) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, seq, self.scatter_idx, self.spg)
