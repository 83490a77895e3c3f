"""The whole sequence's loss from each sequence-parallel rank's piece of it.

Each rank computes the mean loss over the good tokens (label != -100) of its piece; the sequence's loss is the
mean over all good tokens, so the pieces weigh by their good-token counts. Every rank of the group computes the
same total (the gather is differentiable: its backward sums what every rank's copy sends back), and the engine
averages gradients over data × sequence ranks, which undoes that sum: the result is exactly the gradient of
one process training on the whole sequence. This is the tutorial's and the Hugging Face Trainer's recipe.
"""
from __future__ import annotations

import torch

from zeroengine import comm


class _GatherScalars(torch.autograd.Function):
    """Every rank's one-element ``value``, in rank order; backward sums the gradients all ranks' copies received
    (torch.distributed.nn.functional.all_gather's rule)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group, world: int) -> torch.Tensor:
        ctx.group, ctx.rank = group, comm.get_rank_in(group)
        out = torch.empty(world, dtype=value.dtype, device=value.device)
        comm.all_gather(out, value.detach().reshape(1).contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.contiguous().clone()
        comm.all_reduce(summed, group=ctx.group)
        return summed[ctx.rank].reshape(()), None, None


def gather_scalars(value: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather of a scalar over ``group``."""
    return _GatherScalars.apply(value, group, comm.get_world_size(group))


def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """The mean loss over the good tokens of the whole sequence, from this rank's ``loss`` (the mean over the good
    tokens of its piece, whose labels are ``shift_labels``): the same value on every rank of ``group``. A piece
    without good tokens weighs nothing (its loss may be nan: 0/0)."""
    good = (shift_labels != -100).sum().to(loss.dtype).reshape(())
    losses = gather_scalars(loss.reshape(()), group)
    counts = gather_scalars(good, group).detach()
    losses = torch.where(counts > 0, losses, torch.zeros_like(losses))
    return (losses * counts).sum() / counts.sum().clamp(min=1)
