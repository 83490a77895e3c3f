"""What every router returns and the arithmetic routers share: capacity, the serving order of assignments,
the auxiliary losses, and :class:`GateOutput` (the routing of a batch, which the dispatcher consumes).

Note: capacity and priority. With ``drop_tokens`` each expert takes at most
``capacity = max(ceil(k * tokens / num_experts * capacity_factor), min_capacity)``
assignments (``eval_capacity_factor`` in eval mode), counted over this rank's
tokens. Assignments queue choice-major: every token's first choice, in token
order, before any second choice (GShard), so a second choice is dropped before
any first choice. With ``use_rts`` (Random Token Selection, top-1 in training,
as DeepSpeed's) a random priority replaces token order: an overflowing expert
keeps a uniformly random subset of its tokens instead of the earliest ones, so
the end of a batch is not the part that is always dropped. Without
``drop_tokens`` (dropless) nothing is dropped and expert batches vary in size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F


def capacity_for(tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """Assignments one expert accepts from ``tokens`` tokens (Note: capacity and priority).

    ``ceil(k * tokens / num_experts * capacity_factor)`` in exact arithmetic on the factor as written
    (1.1 is 11/10): in floats 100 * 1.1 / 2 is 55.000000000000007, whose ceil would be 56.
    """
    factor = Fraction(repr(float(capacity_factor)))
    return max(math.ceil(Fraction(k * tokens, num_experts) * factor), min_capacity)


@dataclass
class GateOutput:
    """Routing of S tokens to k experts each.

    ``expert_index [S, k]`` global expert ids; ``weights [S, k]`` fp32 combine
    weights (0 where not kept); ``routed [S, k]`` whether the assignment was
    made at all (GShard's random second-expert policy may skip one); ``kept``
    whether it survived capacity; ``exp_counts [E]`` routed assignments per
    expert (before capacity); ``kept_counts [E]`` assignments each expert
    serves; ``order`` a stable sort of the choice-major flattened assignments
    by expert, reused by the dispatcher (which takes the kept ones from it, so
    each expert sees its kept rows in token order whatever chose them).
    """

    expert_index: torch.Tensor
    weights: torch.Tensor
    routed: torch.Tensor
    kept: torch.Tensor
    l_aux: torch.Tensor
    exp_counts: torch.Tensor
    kept_counts: torch.Tensor
    order: torch.Tensor
    capacity: int | None

    @property
    def num_dropped(self) -> int:
        """Routed assignments dropped for lack of capacity."""
        return int((self.routed & ~self.kept).sum())

    @classmethod
    def from_choices(cls, expert_index: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     capacity: int | None = None, l_aux: torch.Tensor | None = None,
                     routed: torch.Tensor | None = None, priority: torch.Tensor | None = None) -> "GateOutput":
        """Positions, capacity drops and counts for given choices (Note: capacity and priority).

        ``priority [S, k]`` (optional): within each choice rank, assignments with a higher priority
        are served first (default: token order). Weights of dropped or unrouted assignments are
        zeroed; nothing is renormalised.
        """
        tokens, k = expert_index.shape
        if routed is None:
            routed = torch.ones_like(expert_index, dtype=torch.bool)
        # Choice-major flattening: all first choices (token order), then all second choices...
        flat = torch.where(routed, expert_index, num_experts).t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        exp_counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        if capacity is None:
            kept_flat = flat < num_experts
            kept_counts = exp_counts
        else:
            # The queue each expert serves: `order` itself, or by priority within each choice rank.
            serve = order if priority is None else _priority_queue(flat, priority)
            starts = torch.cumsum(exp_counts, 0) - exp_counts
            sorted_expert = flat[serve]
            pos_sorted = torch.arange(flat.numel(), device=flat.device) - F.pad(starts, (0, 1))[sorted_expert]
            position = torch.empty_like(pos_sorted)
            position[serve] = pos_sorted
            kept_flat = (flat < num_experts) & (position < capacity)
            kept_counts = exp_counts.clamp(max=capacity)
        kept = kept_flat.view(k, tokens).t()
        weights = weights.float() * kept
        if l_aux is None:
            l_aux = torch.zeros((), device=expert_index.device)
        return cls(expert_index, weights, routed, kept, l_aux, exp_counts.detach(), kept_counts.detach(), order,
                   capacity)


def _priority_queue(flat: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
    """Choice-major flat assignments sorted by expert, each expert's in serving order: choice rank
    first (every first choice before any second), then descending ``priority [S, k]``."""
    tokens, k = priority.shape
    within = torch.argsort(priority.t().float(), dim=1, descending=True, stable=True)  # [k, S] token ids
    queue = (within + torch.arange(k, device=flat.device).unsqueeze(1) * tokens).reshape(-1)
    return queue[torch.argsort(flat[queue], stable=True)]


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``num_experts * sum_i f_i * P_i``: f_i the fraction of tokens whose first
    choice is expert i, P_i the mean router probability of expert i. 1.0 when perfectly balanced."""
    f = torch.bincount(first_choice, minlength=num_experts).float() / max(first_choice.numel(), 1)
    return num_experts * torch.sum(f * probs.mean(0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean squared log-partition of the logits (keeps them small)."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()
