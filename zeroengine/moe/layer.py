"""``zeroengine.moe.MoE``: a Mixture-of-Experts layer (gate -> dispatch -> local experts -> combine)."""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dispatch import AllToAllDispatch, DispatchPlan, LocalDispatch
from .expert_group import expert_output
from .experts import init_experts, make_local_experts
from .fused_route import applies as fused_route_applies
from .gate import TopKGate
from .groups import expert_groups


class MoE(nn.Module):
    """``num_experts`` copies of ``expert``, ``num_experts / ep_size`` of them on this rank.

    ``forward(x [..., hidden_size])`` returns ``(output, l_aux, exp_counts)``:
    ``output`` shaped like ``x``; ``l_aux`` the gate's auxiliary loss (add
    ``coef * l_aux`` to the training loss); ``exp_counts [num_experts]`` the
    assignments routed to each expert from this rank's tokens (before capacity).

    The constructor is collective when ``ep_size > 1`` (it may create process
    groups; see :mod:`zeroengine.moe.groups`). Beyond DeepSpeed's arguments:
    ``gate`` replaces the router by any module returning a
    :class:`~zeroengine.moe.routing.GateOutput`; ``second_expert_policy`` and
    ``z_loss_coef`` go to :class:`~zeroengine.moe.gate.TopKGate`; ``impl``
    picks the permutation kernels (``"auto"``, ``"kernel"``, ``"torch"``).
    ``expert_layout="stacked"`` holds standard-MLP experts as stacked ``[E_local, ...]``
    parameters (:class:`~zeroengine.moe.grouped.GroupedMLPExperts`); ``grouped``
    (``"auto"``, ``"on"``, ``"off"``) runs standard-MLP experts as grouped GEMMs
    (see :mod:`zeroengine.moe.grouped`).
    With ``use_residual`` (Residual MoE) a dense copy of ``expert`` runs on
    every token and a learned 2-way softmax mixes it with the MoE output.

    DeepSpeed's other keywords (see docs/moe.md, "Coming from DeepSpeed"):
    ``use_rts`` (Random Token Selection, top-1 only as in DeepSpeed; default
    False here, True in DeepSpeed), ``top2_2nd_expert_sampling`` (the same as
    ``second_expert_policy="sample"``; default off here, on in DeepSpeed),
    ``use_tutel`` (accepted: the fused permutation kernels already do Tutel's
    job) and ``enable_expert_tensor_parallelism`` (only False: no tensor
    parallelism). Past ``min_capacity`` DeepSpeed's positional order differs
    (``use_residual, noisy_gate_policy, drop_tokens``): pass those by keyword.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_residual: bool = False, *,
                 use_rts: bool = False, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool | None = None, gate: nn.Module | None = None,
                 second_expert_policy: str | None = None, z_loss_coef: float = 0.0,
                 impl: str = "auto", expert_layout: str = "modules", grouped: str = "auto"):
        super().__init__()
        _check_positional_order(noisy_gate_policy, drop_tokens, use_residual)
        if enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism=True: zeroengine has no tensor parallelism, so "
                             "experts are never split across model-parallel ranks; remove the argument "
                             "(expert parallelism is ep_size)")
        second_expert_policy = _second_expert_policy(second_expert_policy, top2_2nd_expert_sampling)
        if num_experts < 1 or ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size ({ep_size}) must divide num_experts ({num_experts})")
        self.hidden_size, self.num_experts, self.ep_size, self.k = hidden_size, num_experts, ep_size, k
        self.groups = expert_groups(ep_size)
        self.num_local_experts = num_experts // ep_size
        first = self.groups.ep_rank * self.num_local_experts
        self.global_expert_ids = list(range(first, first + self.num_local_experts))
        self.gate = gate if gate is not None else TopKGate(
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy,
            drop_tokens, second_expert_policy, z_loss_coef, use_rts=use_rts)
        self.local_experts = make_local_experts(expert, self.global_expert_ids, ep_size, expert_layout, grouped)
        self.use_residual = use_residual
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        self.impl = impl
        self.use_tutel = use_tutel  # recorded only: impl="auto" already runs the fused kernels
        self._dispatch = LocalDispatch() if ep_size == 1 else AllToAllDispatch(self.groups, self.num_local_experts)

    def init_experts(self, init_fn: Callable[[nn.Module], None], seed: int) -> None:
        """Initialise expert g with ``init_fn`` under seed ``seed + g`` (same weights at any ``ep_size``)."""
        init_experts(self.local_experts, self.global_expert_ids, init_fn, seed)

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None):
        if used_token is not None:
            raise NotImplementedError("MoE.forward(used_token=...) (DeepSpeed's mask of tokens to route, top-1 "
                                      "only) is not supported: drop the unused tokens from x instead")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE expects a last dimension of {self.hidden_size}, got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden_size)
        if self.ep_size == 1 and tokens.shape[0] and fused_route_applies(self.gate, tokens, self.impl):
            out, l_aux, exp_counts = self._dispatch.route_and_run(self.gate, tokens, self.local_experts, self.impl)
        else:
            routing = self.gate(tokens)
            plan = DispatchPlan.from_gate(routing)
            out = self._dispatch(tokens, plan, self.local_experts, impl=self.impl)
            l_aux, exp_counts = routing.l_aux, routing.exp_counts
        if self.use_residual:
            coef = F.softmax(self.coefficient(tokens).float(), dim=-1).to(out.dtype)
            out = out * coef[:, :1] + expert_output(self.mlp(tokens)) * coef[:, 1:]
        return out.view(x.shape), l_aux, exp_counts


def _check_positional_order(noisy_gate_policy, drop_tokens, use_residual) -> None:
    """Catch a call written in DeepSpeed's positional order (``..., min_capacity, use_residual,
    noisy_gate_policy, drop_tokens``), where the types give it away."""
    # In DeepSpeed's order a bool lands in noisy_gate_policy and a policy (str or None) in drop_tokens.
    if isinstance(noisy_gate_policy, bool) or drop_tokens is None or isinstance(drop_tokens, str):
        raise TypeError(
            "MoE: after min_capacity zeroengine's positional order is (noisy_gate_policy, drop_tokens, "
            "use_residual) and DeepSpeed's is (use_residual, noisy_gate_policy, drop_tokens); got "
            f"noisy_gate_policy={noisy_gate_policy!r}, drop_tokens={drop_tokens!r}, "
            f"use_residual={use_residual!r}. Pass these arguments by keyword")


def _second_expert_policy(policy: str | None, sampling: bool | None) -> str:
    """``second_expert_policy`` from it or from DeepSpeed's ``top2_2nd_expert_sampling`` (default "all")."""
    if sampling is None:
        return "all" if policy is None else policy
    if policy is not None and (policy == "sample") != bool(sampling):
        raise ValueError(f"second_expert_policy={policy!r} contradicts top2_2nd_expert_sampling={sampling!r}; "
                         "give one of them")
    return "sample" if sampling else (policy or "all")
