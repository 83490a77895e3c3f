"""Megatron-LM's four tensor-parallel communication operators, as autograd functions over the tensor group.

A column-parallel layer gives each rank a slice of the output features; a row-parallel layer a slice of the
input features, whose partial products are summed. Between them travel (Shoeybi et al. 2019, section 3):

* ``copy_to``: identity forward, all-reduce of the gradient backward ("f" in the paper), before a
  column-parallel layer, whose input every rank uses whole;
* ``reduce_from``: all-reduce forward, identity backward ("g"), after a row-parallel layer;
* ``gather_from``: all-gather of the last dimension forward, this rank's slice of the gradient backward
  (a column-parallel output needed whole, e.g. logits for a loss that is not vocabulary-parallel);
* ``scatter_to``: this rank's slice forward, all-gather backward.

So a transformer block (attention, then MLP: each a column-parallel layer followed by a row-parallel one)
all-reduces its activations twice forward and twice backward. Every collective goes through
:mod:`zeroengine.comm`, so it is counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroengine import comm


@dataclass(frozen=True)
class TensorGroup:
    """The ranks splitting a layer: their process group (None: the world), how many, and this rank's place.
    A size of 1 means no split (the operators are identities), whatever ``group`` is."""

    group: object
    size: int
    rank: int

    @staticmethod
    def of(group) -> "TensorGroup":
        """A process group given as such (a user's own), or a TensorGroup already."""
        if isinstance(group, TensorGroup):
            return group
        return TensorGroup(group, comm.get_world_size(group), comm.get_rank_in(group))


SOLO = TensorGroup(None, 1, 0)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tg):
        ctx.tg = tg
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.tg.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tg):
        x = x.contiguous().clone()
        comm.all_reduce(x, group=tg.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_last(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((tg.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out.view(-1), x.view(-1), group=tg.group)
    return torch.cat(out.unbind(0), dim=-1)


def _slice_last(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    return x.chunk(tg.size, dim=-1)[tg.rank].contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tg):
        ctx.tg = tg
        return _gather_last(x, tg)

    @staticmethod
    def backward(ctx, grad):
        return _slice_last(grad, ctx.tg), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tg):
        ctx.tg = tg
        return _slice_last(x, tg)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.tg), None


def copy_to(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    return x if tg.size == 1 else _Copy.apply(x, tg)


def reduce_from(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    return x if tg.size == 1 else _Reduce.apply(x, tg)


def gather_from(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    return x if tg.size == 1 else _Gather.apply(x, tg)


def scatter_to(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    return x if tg.size == 1 else _Scatter.apply(x, tg)
