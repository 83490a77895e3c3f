"""The top-k router's work after its logits GEMM as one fused CPU op, and its PyTorch definition.

:class:`~zeroengine.moe.gate.TopKGate` hands its fp32 logits here (:func:`route_fused`) when the
C++ kernel applies: CPU, fp32, k <= 8, deterministic choices in token order (not, in training,
GShard's random or sampled second expert, nor Random Token Selection). The kernel (ops/csrc/moe/moe_gate_cpu.cpp) computes in one pass forward
what :func:`topk_gate_reference` computes with ~20 PyTorch ops: the softmax's top-k, capacity
positions and drops (Note: capacity and priority in routing.py), counts, combine weights, the
load-balancing loss, and the dispatch maps the dispatcher would otherwise rebuild from a sort
(``rows``/``index`` of :class:`~zeroengine.moe.dispatch.DispatchPlan`); backward is one pass
from the weights' and the loss's gradients to the logits'. Elsewhere the gate's PyTorch path
runs unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroengine.ops.moe_dispatch import cpu_kernel

from .routing import GateOutput, router_z_loss

MAX_K = 8  # the kernel keeps the running top-k in registers


@dataclass
class RoutedGateOutput(GateOutput):
    """A :class:`GateOutput` that also carries the dispatch maps (``rows [S, k]``, ``index [kept]``)."""

    rows: torch.Tensor | None = None
    index: torch.Tensor | None = None


def topk_gate_reference(logits: torch.Tensor, select: torch.Tensor, k: int, capacity: int | None,
                        renormalize: bool) -> dict[str, torch.Tensor]:
    """The definition, in PyTorch (differentiable in ``logits``). Returns:

    ``expert_index [S, k]`` top-k of ``select`` (best first); ``weights [S, k]`` the chosen softmax
    probabilities, zeroed where dropped, renormalised over the kept ones if ``renormalize``;
    ``kept [S, k]``; ``exp_counts`` / ``kept_counts`` / ``first_counts [E]`` assignments routed /
    kept / first choices per expert; ``rows [S, k]`` each kept assignment's row in expert-major,
    choice-major order (-1 if dropped) and ``index [kept]`` each row's token; ``order [S*k]`` the
    stable sort by expert of the choice-major assignments; ``l_aux`` = E * sum_i f_i P_i.
    """
    tokens, num = logits.shape
    probs = F.softmax(logits, dim=-1)
    expert_index = torch.topk(select, k, dim=-1).indices
    chosen = probs.gather(1, expert_index)
    flat = expert_index.t().reshape(-1)  # choice-major
    order = torch.argsort(flat, stable=True)
    exp_counts = torch.bincount(flat, minlength=num)
    starts = torch.cumsum(exp_counts, 0) - exp_counts
    pos_flat = torch.empty_like(flat)
    pos_flat[order] = torch.arange(flat.numel()) - starts[flat[order]]
    pos = pos_flat.view(k, tokens).t()
    kept = torch.ones_like(pos, dtype=torch.bool) if capacity is None else pos < capacity
    kept_counts = exp_counts if capacity is None else exp_counts.clamp(max=capacity)
    kept_start = torch.cumsum(kept_counts, 0) - kept_counts
    rows = torch.where(kept, kept_start[expert_index] + pos, -1)
    index = torch.empty(int(kept_counts.sum()), dtype=torch.long)
    index[rows[kept]] = torch.arange(tokens).unsqueeze(1).expand(tokens, k)[kept]
    weights = chosen * kept
    if renormalize:
        weights = weights / weights.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    first_counts = torch.bincount(expert_index[:, 0], minlength=num)
    l_aux = num * torch.sum(first_counts.float() / max(tokens, 1) * probs.mean(0))
    return {"expert_index": expert_index, "weights": weights, "kept": kept, "exp_counts": exp_counts,
            "kept_counts": kept_counts, "first_counts": first_counts, "rows": rows, "index": index,
            "order": order, "l_aux": l_aux}


def kernel_forward(kernel, logits, select, k: int, capacity: int | None, renormalize: bool):
    """Softmax, then the kernel's one pass: ``(probs, kernel outputs, l_aux, aux scale)``; the outputs are
    (expert_index, chosen, kept, weights, exp_counts, kept_counts, first_counts, prob_sum, rows, index, order).
    Shared by this gate and the gate-plus-gather node (:mod:`zeroengine.moe.fused_route`)."""
    probs = torch.softmax(logits, dim=-1)
    outs = kernel.topk_gate_forward(probs, select, k, -1 if capacity is None else capacity, renormalize)
    tokens, num = logits.shape
    scale = num / max(tokens, 1) ** 2
    first_counts, prob_sum = outs[6], outs[7]
    return probs, outs, torch.dot(first_counts.float(), prob_sum) * scale, scale


def kernel_grad_logits(kernel, probs, expert_index, chosen, kept, first_counts, grad_weights, grad_l_aux,
                       scale: float, renormalize: bool) -> torch.Tensor:
    """The logits' gradient from the combine weights' and l_aux's gradients (either may be None)."""
    if grad_weights is None:
        grad_weights = torch.zeros_like(chosen)
    # d l_aux / d probs[t, e] = scale * first_counts[e], the same for every token.
    aux_coef = (first_counts.float() * scale * grad_l_aux if grad_l_aux is not None
                else torch.zeros(probs.shape[1]))
    return kernel.topk_gate_backward(probs, expert_index, chosen, kept, grad_weights.float().contiguous(),
                                     aux_coef.contiguous(), renormalize)


class _FusedTopKGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, select, k, capacity, renormalize, kernel):
        probs, outs, l_aux, scale = kernel_forward(kernel, logits, select, k, capacity, renormalize)
        (expert_index, chosen, kept, weights, exp_counts, kept_counts, first_counts, _prob_sum, rows, index,
         order) = outs
        ctx.save_for_backward(probs, expert_index, chosen, kept, first_counts)
        ctx.kernel, ctx.renormalize, ctx.scale = kernel, renormalize, scale
        ctx.mark_non_differentiable(expert_index, kept, exp_counts, kept_counts, first_counts, rows, index, order)
        return weights, l_aux, expert_index, kept, exp_counts, kept_counts, first_counts, rows, index, order

    @staticmethod
    def backward(ctx, grad_weights, grad_l_aux, *_):
        probs, expert_index, chosen, kept, first_counts = ctx.saved_tensors
        grad = kernel_grad_logits(ctx.kernel, probs, expert_index, chosen, kept, first_counts, grad_weights,
                                  grad_l_aux, ctx.scale, ctx.renormalize)
        return grad, None, None, None, None, None


def topk_gate_fused(logits: torch.Tensor, select: torch.Tensor, k: int, capacity: int | None, renormalize: bool,
                    impl: str = "auto") -> dict[str, torch.Tensor] | None:
    """:func:`topk_gate_reference` by the C++ kernel (same keys), or None where it does not apply."""
    if logits.dtype != torch.float32 or k > MAX_K or logits.dim() != 2:
        if impl == "kernel":
            raise ValueError("the fused top-k gate takes 2-d float32 logits and k <= 8")
        return None
    kernel = cpu_kernel(logits, impl)
    if kernel is None:
        return None
    outs = _FusedTopKGate.apply(logits.contiguous(), select.contiguous(), k, capacity, renormalize, kernel)
    keys = ("weights", "l_aux", "expert_index", "kept", "exp_counts", "kept_counts", "first_counts", "rows", "index",
            "order")
    return dict(zip(keys, outs))


def route_fused(gate, logits: torch.Tensor, select: torch.Tensor, capacity: int | None) -> RoutedGateOutput | None:
    """The :class:`~zeroengine.moe.gate.TopKGate` output for these logits by the fused kernel, or None
    where it does not apply (the gate then runs its PyTorch path)."""
    # Random routing choices (GShard's random / sampled second expert, Random Token Selection) stay in PyTorch.
    if gate.training and ((gate.k > 1 and gate.second_expert_policy != "all")
                          or (getattr(gate, "use_rts", False) and gate.k == 1 and capacity is not None)):
        return None
    r = topk_gate_fused(logits, select, gate.k, capacity, renormalize=gate.k > 1)
    if r is None:
        return None
    l_aux = r["l_aux"]
    if gate.z_loss_coef:
        l_aux = l_aux + gate.z_loss_coef * router_z_loss(logits)
    kept = r["kept"]
    return RoutedGateOutput(r["expert_index"], r["weights"], torch.ones_like(kept), kept, l_aux, r["exp_counts"],
                            r["kept_counts"], r["order"], capacity, rows=r["rows"], index=r["index"])
