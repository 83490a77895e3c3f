"""Partitioned saved inputs: each model-parallel rank keeps 1/N of a replicated tensor.

Under tensor (model) parallelism the input of a transformer block is the same
on every rank of the model-parallel group, so saving it whole on each of the N
ranks stores N copies. With ``partition_activations`` each rank keeps only its
contiguous 1/N slice of the flattened tensor (the last slice zero-padded so all
slices have one size, which the flat all-gather needs) and the recompute
all-gathers the slices back. The correctness of this relies on the input really
being replicated across the group, as DeepSpeed's does.
"""
from __future__ import annotations

import math

import torch

from zeroengine import comm


def slice_numel(numel: int, parts: int) -> int:
    return math.ceil(numel / parts)


def own_slice(tensor: torch.Tensor, parts: int, rank: int) -> torch.Tensor:
    """This rank's padded slice of ``tensor`` flattened (a fresh tensor: the full one can be freed)."""
    flat = tensor.detach().reshape(-1)
    size = slice_numel(flat.numel(), parts)
    start = min(rank * size, flat.numel())
    piece = flat[start:start + size]
    out = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
    out[:piece.numel()].copy_(piece)
    return out


def gather_slices(piece: torch.Tensor, shape: torch.Size, parts: int, group) -> torch.Tensor:
    """The full tensor of ``shape`` from every rank's slice (``piece`` is this rank's, on the compute device)."""
    full = torch.empty(parts * piece.numel(), dtype=piece.dtype, device=piece.device)
    comm.all_gather(full, piece.contiguous(), group=group)
    return full[:math.prod(shape)].view(shape)
