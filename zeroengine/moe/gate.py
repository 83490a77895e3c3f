"""Routers: which experts each token goes to, with what weight, and what is dropped.

A gate maps ``x [tokens, hidden]`` to a :class:`~zeroengine.moe.routing.GateOutput`.
:class:`TopKGate` is the built-in one (top-1 as in Switch Transformer, top-2 as in GShard);
a custom router is any module returning a ``GateOutput``, most easily through
:meth:`GateOutput.from_choices`. Capacity and the order in which assignments are served:
"Note: capacity and priority" in routing.py.

Note: routing arithmetic. Logits, softmax, noise, the auxiliary losses and the
combine weights are computed in fp32 whatever the model's dtype (bf16/fp16
router logits mis-rank near-ties and underflow the z-loss); the router's weight
stays in the model's dtype and receives its gradient there.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fused_gate
from .routing import GateOutput, capacity_for, load_balancing_loss, router_z_loss

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")  # DeepSpeed's string "None" is read as None
SECOND_EXPERT_POLICIES = ("all", "random", "sample")
JITTER_EPS = 1e-2


class TopKGate(nn.Module):
    """Top-k router (k = 1: Switch; k = 2: GShard) with capacity, noise and auxiliary losses.

    ``noisy_gate_policy``: ``"Jitter"`` multiplies the router input by
    U(1-eps, 1+eps) noise, ``"RSample"`` adds Gumbel noise to the logits used to
    *choose* experts (the combine weights stay the noiseless softmax); both only
    in training. ``second_expert_policy`` (k >= 2, training only): ``"all"``
    takes the top-k; ``"random"`` is GShard's random routing (k = 2): the second
    choice is dispatched with probability ``min(1, 2 * g2 / (g1 + g2))``;
    ``"sample"`` is DeepSpeed's ``top2_2nd_expert_sampling``: the choices after
    the first are drawn from the router's softmax over the remaining experts
    (Gumbel-max on the logits). For k >= 2 the combine weights are the chosen
    probabilities renormalised over the assignments that were kept.
    ``use_rts`` (k = 1, training, with capacity): Random Token Selection, see
    the module note. ``l_aux`` = load-balancing loss + ``z_loss_coef`` * router z-loss.
    """

    def __init__(self, hidden_size: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, second_expert_policy: str = "all", z_loss_coef: float = 0.0,
                 use_rts: bool = False):
        super().__init__()
        if noisy_gate_policy == "None":
            noisy_gate_policy = None
        if not 1 <= k <= num_experts:
            raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")
        if second_expert_policy not in SECOND_EXPERT_POLICIES:
            raise ValueError(f"second_expert_policy must be one of {SECOND_EXPERT_POLICIES}")
        if capacity_factor <= 0 or eval_capacity_factor <= 0 or min_capacity < 0:
            raise ValueError("capacity factors must be positive and min_capacity non-negative")
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)
        self.num_experts, self.k = num_experts, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.second_expert_policy = second_expert_policy
        self.z_loss_coef = z_loss_coef
        self.use_rts = use_rts

    def capacity(self, tokens: int) -> int | None:
        if not self.drop_tokens:
            return None
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return capacity_for(tokens, self.num_experts, self.k, factor, self.min_capacity)

    def forward(self, x: torch.Tensor) -> GateOutput:
        x = x.float()
        if self.training and self.noisy_gate_policy == "Jitter":
            x = x * torch.empty_like(x).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        logits = F.linear(x, self.wg.weight.float())
        select = logits
        if self.training and self.noisy_gate_policy == "RSample":
            select = logits + _gumbel_like(logits)
        if logits.device.type == "cpu":  # everything below in one C++ pass where it applies
            fused = fused_gate.route_fused(self, logits, select, self.capacity(x.shape[0]))
            if fused is not None:
                return fused
        probs = F.softmax(logits, dim=-1)
        if self.k > 1 and self.second_expert_policy == "sample" and self.training:
            expert_index = _sample_after_first(select, logits, self.k)
        else:
            expert_index = torch.topk(select, self.k, dim=-1).indices
        chosen = probs.gather(1, expert_index)
        routed = None
        if self.k == 2 and self.second_expert_policy == "random" and self.training:
            g2 = chosen[:, 1] / chosen.sum(1).clamp(min=torch.finfo(torch.float32).eps)
            second = torch.rand_like(g2) < 2.0 * g2
            routed = torch.stack([torch.ones_like(second), second], dim=1)
        l_aux = load_balancing_loss(probs, expert_index[:, 0], self.num_experts)
        if self.z_loss_coef:
            l_aux = l_aux + self.z_loss_coef * router_z_loss(logits)
        capacity = self.capacity(x.shape[0])
        priority = None
        if self.use_rts and self.k == 1 and self.training and capacity is not None:
            priority = torch.rand(expert_index.shape, device=logits.device)
        out = GateOutput.from_choices(expert_index, chosen, self.num_experts, capacity, l_aux, routed, priority)
        if self.k > 1:
            # Renormalise over what was kept: a token whose first choice overflowed leans on its second.
            out.weights = out.weights / out.weights.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
        return out


def _sample_after_first(select: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """First choice: the top of ``select``; the other k-1: drawn without replacement from the softmax of
    ``logits`` over the remaining experts (Gumbel-top-k)."""
    first = select.argmax(dim=-1, keepdim=True)
    rest = (logits + _gumbel_like(logits)).scatter(1, first, float("-inf"))
    return torch.cat([first, torch.topk(rest, k - 1, dim=-1).indices], dim=1)


def _gumbel_like(logits: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise shaped like ``logits`` (the uniform draw kept off 0 and 1)."""
    return -torch.log(-torch.log(torch.rand_like(logits).clamp_(1e-20, 1.0 - 1e-7)))
