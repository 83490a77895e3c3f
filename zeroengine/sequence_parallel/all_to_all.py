"""The two all-to-alls of Ulysses attention: from this rank's part of the sequence with every head, to the whole
sequence with this rank's part of the heads, and back.

A rank of an sp-way sequence group holds ``[batch, heads, seq/sp, dim]``. Cutting the heads into sp blocks and
sending block i to rank i (one all-to-all over the group) leaves each rank ``[batch, heads/sp, seq, dim]``: the
sequence pieces arrive from the ranks in rank order, which is their order in the sequence (rank i holds piece i).
Attention is then exact, each rank over the whole sequence for its heads; the inverse exchange returns its output
to the sequence layout. An all-to-all along dimension 0 is its own adjoint, so backward is the same exchange of
the gradient.
"""
from __future__ import annotations

import torch

from zeroengine import comm


class _DimZeroAllToAll(torch.autograd.Function):
    """``x[i]`` goes to rank i of ``group``; slot j of the result came from rank j."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=group)
    return out


def dim_zero_all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all of ``x``'s dimension 0 (its size: the group's)."""
    return _DimZeroAllToAll.apply(x, group)


def sequence_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[batch, heads, seq/sp, dim]`` (this rank's piece of the sequence) -> ``[batch, heads/sp, seq, dim]``
    (this rank's heads)."""
    batch, heads, local, dim = x.shape
    blocks = x.reshape(batch, world, heads // world, local, dim).transpose(0, 1)  # [sp, batch, heads/sp, s/sp, d]
    received = dim_zero_all_to_all(blocks, group)  # slot j: sequence piece j
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world, world * local, dim)


def heads_to_sequence(y: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[batch, heads/sp, seq, dim]`` -> ``[batch, heads, seq/sp, dim]``: the inverse of :func:`sequence_to_heads`."""
    batch, local_heads, seq, dim = y.shape
    pieces = y.reshape(batch, local_heads, world, seq // world, dim).permute(2, 0, 1, 3, 4)  # [sp, b, h/sp, s/sp, d]
    received = dim_zero_all_to_all(pieces, group)  # slot j: head block j
    return received.transpose(0, 1).reshape(batch, world * local_heads, seq // world, dim)
