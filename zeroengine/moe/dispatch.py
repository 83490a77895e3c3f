"""Moving tokens to their experts and back: the local and the all-to-all strategy.

Both start from a :class:`DispatchPlan` (the gate's routing as index maps) and
use the fused permutation ops (:mod:`zeroengine.ops.moe_dispatch`): tokens are
gathered into expert-contiguous order once, each expert runs on one contiguous
slice, and outputs are un-permuted and combined with the gate weights in one
pass. No token-level Python loop, no [tokens, experts, capacity] masks.

The all-to-all strategy adds, between permute and combine: an exchange of
per-expert counts, an all-to-all of the rows (uneven splits: each rank sends
exactly the rows its peers' experts serve, so dropless needs no padding), a
regrouping from source-rank-major to local-expert-major order, and the
reverse on the way back. Backward runs the same all-to-alls in reverse.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroengine import comm
from zeroengine.ops.moe_dispatch import (
    permute_tokens,
    permute_tokens_split,
    unpermute_combine,
    unpermute_combine_segments,
)

from .expert_group import SERIAL_BELOW, run_expert_modules
from .experts import run_experts, runs_per_module
from .fused_route import route_gather
from .gate import TopKGate
from .groups import ExpertGroups
from .routing import GateOutput


@dataclass
class DispatchPlan:
    """``index [N]``: the token of each expert-ordered row; ``rows [S, k]``: the row of each kept
    assignment (-1 if dropped); ``weights [S, k]``; ``count_tensor [E]``: rows per expert, where the gate
    computed them (the device); :attr:`counts` the same as host ints, read once when first asked for (the
    all-to-all path reads its counts together with the peers' instead: one wait for the device per layer)."""

    index: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor
    count_tensor: torch.Tensor
    checked: bool = False  # maps from the fused gate kernel: in range by construction
    _counts: list[int] | None = None

    @property
    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = self.count_tensor.tolist()
        return self._counts

    @classmethod
    def from_gate(cls, gate: GateOutput) -> "DispatchPlan":
        if getattr(gate, "rows", None) is not None:  # the fused gate built the maps (moe/fused_gate.py)
            return cls(gate.index, gate.rows, gate.weights, gate.kept_counts, checked=True)
        tokens, k = gate.expert_index.shape
        kept_flat = gate.kept.t().reshape(-1)
        # gate.order sorts assignments by expert with the kept ones first in each expert.
        selected = gate.order[kept_flat[gate.order]]
        rows_flat = torch.full((tokens * k,), -1, dtype=torch.long, device=selected.device)
        rows_flat[selected] = torch.arange(selected.numel(), device=selected.device)
        rows = rows_flat.view(k, tokens).t().contiguous()
        return cls(selected % tokens, rows, gate.weights, gate.kept_counts)


class LocalDispatch:
    """Every expert on this rank (``ep_size == 1``)."""

    def __call__(self, x: torch.Tensor, plan: DispatchPlan, experts, impl: str = "auto") -> torch.Tensor:
        if runs_per_module(experts):  # one input and one output tensor per expert: nothing concatenated
            rows_in = permute_tokens_split(x, plan.index, plan.rows, plan.counts, impl=impl, checked=plan.checked)
        else:
            rows_in = permute_tokens(x, plan.index, plan.rows, impl=impl)
        return _run_and_combine(experts, rows_in, plan.rows, plan.weights, plan.counts, impl, plan.checked)

    def route_and_run(self, gate: TopKGate, x: torch.Tensor, experts, impl: str = "auto"):
        """Gate and dispatch with routing and gather as one node (see :mod:`zeroengine.moe.fused_route`;
        only where ``fused_route.applies``): returns ``(output, l_aux, exp_counts)``."""
        rows_in, weights, l_aux, exp_counts, kept_counts, rows = route_gather(gate, x, runs_per_module(experts),
                                                                             impl)
        out = _run_and_combine(experts, rows_in, rows, weights, kept_counts.tolist(), impl, checked=True)
        return out, l_aux, exp_counts


def _run_and_combine(experts, rows_in, rows, weights, counts: list[int], impl: str, checked: bool) -> torch.Tensor:
    """The experts on their rows (one tensor per expert, or all in one with ``counts``), then the weighted
    combine back into token order."""
    if isinstance(rows_in, (list, tuple)):
        ys = run_expert_modules(experts, rows_in, getattr(experts, "serial_below", SERIAL_BELOW))
        return unpermute_combine_segments(ys, rows, weights, covers_all=True, impl=impl, checked=checked)
    y = run_experts(experts, rows_in, counts)
    return unpermute_combine(y, rows, weights, covers_all=True, impl=impl)


class _AllToAll(torch.autograd.Function):
    """Rows to and from the peers of an expert-parallel group; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        comm.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty(sum(send_splits), *grad.shape[1:])
        comm.all_to_all_single(out, grad.contiguous(), output_split_sizes=send_splits,
                               input_split_sizes=recv_splits, group=ctx.group)
        return out, None, None, None


def _regroup_index(recv: torch.Tensor) -> torch.Tensor:
    """For rows arriving as ``[source rank][local expert]`` blocks of sizes ``recv [ep, L]``, the
    permutation that lists them ``[local expert][source rank]`` (each expert's batch contiguous)."""
    sizes = recv.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(recv)
    lengths_t, starts_t = recv.t().reshape(-1), starts.t().reshape(-1)
    total = int(sizes.sum())
    block_start = torch.repeat_interleave(starts_t, lengths_t, output_size=total)
    offset_in_block = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lengths_t, 0) - lengths_t,
                                                                     lengths_t, output_size=total)
    return block_start + offset_in_block


class AllToAllDispatch:
    """Experts spread over an expert-parallel group of ``ep_size`` ranks, ``num_local`` each."""

    def __init__(self, groups: ExpertGroups, num_local: int):
        self.groups = groups
        self.ep_size = groups.ep_size
        self.num_local = num_local

    def __call__(self, x: torch.Tensor, plan: DispatchPlan, experts, impl: str = "auto") -> torch.Tensor:
        ep, local, group = self.ep_size, self.num_local, self.groups.ep_group
        permuted = permute_tokens(x, plan.index, plan.rows, impl=impl)
        # Counts travel first so every rank can size its receive buffer (and the uneven splits). They stay
        # where the gate computed them until both directions are known: one read on the host per layer.
        send_counts = plan.count_tensor.to(device=comm.device_for_backend(), dtype=torch.long)
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all_single(recv_counts, send_counts, group=group)
        both = torch.stack([send_counts, recv_counts]).cpu()
        recv = both[1].view(ep, local)  # [source rank, local expert]
        send_splits = both[0].view(ep, local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        arrived = _AllToAll.apply(permuted, send_splits, recv_splits, group)
        if local > 1:
            order = _regroup_index(recv).to(x.device)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            grouped = permute_tokens(arrived, order, inverse.unsqueeze(1), impl=impl)
            y = run_experts(experts, grouped, recv.sum(0).tolist())
            y = permute_tokens(y, inverse, order.unsqueeze(1), impl=impl)
        else:
            y = run_experts(experts, arrived, recv.sum(0).tolist())
        back = _AllToAll.apply(y, recv_splits, send_splits, group)
        return unpermute_combine(back, plan.rows, plan.weights, covers_all=True, impl=impl)
