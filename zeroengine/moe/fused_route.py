"""Routing and gathering as one autograd node on CPU: the router's logits GEMM, softmax, the fused
top-k kernel and the gather of tokens into expert order, for the built-in gate on one rank.

Note: one node for gate and gather. The input ``x`` feeds two paths, the router's logits and
the gathered rows; run as separate nodes, each backward writes a ``[tokens, hidden]`` gradient
and autograd adds them (an 8 MiB allocation and a pass reading 16 MiB at 4096 x 512, fp32).
Here backward scatters the rows' gradients into one buffer and adds the router's part into it
with the GEMM itself (``addmm_``, beta = 1), and the router's weight gradient is the other GEMM.
Where the small-row GEMM kernels are built (AVX2 + FMA) the router's logits and weight gradient use
them too (ops/csrc/moe/moe_router_cpu.cpp: skinny GEMMs, E = 8-64 columns, where they beat MKL).
The forward is what :class:`~zeroengine.moe.gate.TopKGate` (its fused-kernel path,
:mod:`zeroengine.moe.fused_gate`) followed by the gather computes, so results are the same; it
applies where that path applies and the gate is plain (:func:`applies`); elsewhere the layer
runs gate and dispatch separately.
"""
from __future__ import annotations

import torch

from zeroengine.ops.moe_dispatch import cpu_kernel

from .fused_gate import MAX_K, kernel_forward, kernel_grad_logits
from .gate import TopKGate
from .grouped import has_hooks


def applies(gate, x: torch.Tensor, impl: str) -> bool:
    """Whether :func:`route_gather` computes what ``gate`` then the gather would (CPU, fp32, the plain
    built-in gate with deterministic choices, no noise or z-loss, no hooks)."""
    if type(gate) is not TopKGate or impl == "torch" or x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if gate.wg.weight.dtype != torch.float32 or gate.k > MAX_K or gate.z_loss_coef or has_hooks(gate):
        return False
    if gate.training and (gate.noisy_gate_policy is not None or (gate.k > 1 and gate.second_expert_policy != "all")
                          or (gate.use_rts and gate.k == 1 and gate.drop_tokens)):
        return False
    return cpu_kernel(x, impl) is not None


def route_gather(gate: TopKGate, x: torch.Tensor, split: bool, impl: str = "auto"):
    """``(rows_in, weights, l_aux, exp_counts, kept_counts, rows)``: ``rows_in`` the tokens in expert
    order, one tensor per expert (``split``) or one tensor; ``weights``/``rows`` ``[S, k]`` as in
    :class:`~zeroengine.moe.dispatch.DispatchPlan`. Call only where :func:`applies`."""
    capacity = gate.capacity(x.shape[0])
    kernel = cpu_kernel(x, impl)
    outs = _RouteGather.apply(x.contiguous(), gate.wg.weight, gate.k, capacity, gate.k > 1, split, kernel)
    n = len(outs) - 5
    return (list(outs[:n]) if split else outs[0]), *outs[n:]


class _RouteGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wg, k, capacity, renormalize, split, kernel):
        wg = wg.contiguous()
        small_gemm = kernel.small_gemm_enabled()  # the router's GEMMs by the small-row kernels (AVX2)
        with _router_in_fp32():
            logits = kernel.router_logits(x, wg) if small_gemm else torch.mm(x, wg.t())
        probs, outs, l_aux, scale = kernel_forward(kernel, logits, logits, k, capacity, renormalize)
        (expert_index, chosen, kept, weights, exp_counts, kept_counts, first_counts, _prob_sum, rows, index,
         _order) = outs
        if split:
            gathered = tuple(kernel.gather_rows_split(x, index, kept_counts.tolist()))
        else:
            gathered = (kernel.gather_rows(x, index),)
        ctx.save_for_backward(x, wg, probs, expert_index, chosen, kept, first_counts, rows)
        ctx.kernel, ctx.renormalize, ctx.scale, ctx.small_gemm = kernel, renormalize, scale, small_gemm
        ctx.row_sizes = [g.shape[0] for g in gathered]
        ctx.mark_non_differentiable(exp_counts, kept_counts, rows)
        return (*gathered, weights, l_aux, exp_counts, kept_counts, rows)

    @staticmethod
    def backward(ctx, *grads):
        with _router_in_fp32():
            return _RouteGather._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        x, wg, probs, expert_index, chosen, kept, first_counts, rows = ctx.saved_tensors
        grad_rows, (grad_weights, grad_l_aux) = grads[:-5], grads[-5:-3]
        kernel = ctx.kernel
        grad_logits = kernel_grad_logits(kernel, probs, expert_index, chosen, kept, first_counts, grad_weights,
                                         grad_l_aux, ctx.scale, ctx.renormalize)
        grad_x = grad_wg = None
        if ctx.needs_input_grad[0]:
            if any(g is not None for g in grad_rows):
                # the rows' gradients scattered back (a unit-weight combine) and the router's part added, in
                # one pass over token blocks where the small-row GEMMs are built, else as two calls
                rows_grads = _fill_missing(grad_rows, ctx.row_sizes, x)
                if ctx.small_gemm:
                    grad_x = kernel.combine_segments_addmm(rows_grads, rows, grad_logits, wg)
                else:
                    grad_x = kernel.combine_segments(rows_grads, rows, None)
                    grad_x.addmm_(grad_logits, wg)
            else:
                grad_x = torch.mm(grad_logits, wg)
        if ctx.needs_input_grad[1]:
            grad_wg = kernel.router_weight_grad(grad_logits, x) if ctx.small_gemm else torch.mm(grad_logits.t(), x)
        return grad_x, grad_wg, None, None, None, None, None


def _router_in_fp32():
    """No CPU autocast around the router's GEMMs: the router runs in fp32 (as the gate's own path does), and
    the fused kernels take fp32 logits."""
    return torch.autocast("cpu", enabled=False)


def _fill_missing(grad_rows, sizes, x):
    """The rows' gradients as contiguous tensors, zeros where autograd passed None (an unused output)."""
    return [x.new_zeros(n, x.shape[1]) if g is None else g.contiguous() for g, n in zip(grad_rows, sizes)]
