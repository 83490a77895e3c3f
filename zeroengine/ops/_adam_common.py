"""What CPUAdam and FusedAdam share: argument checks, the torch-compatible
state layout, and the pure-PyTorch reference step that defines the math."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from zeroengine.ops.optimizer_protocol import load_state_keeping_moments

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Moments: fp32 (the default, whatever the param dtype), or bf16 (bf16.bf16_optimizer_states: 4 bytes a parameter
# for the two instead of 8). fp16 moments are not offered: exp_avg_sq underflows to 0 and the next step divides by eps.
STATE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class AdamHyper:
    """One param group's hyperparameters, checked."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool

    @classmethod
    def from_group(cls, group: dict) -> "AdamHyper":
        if group.get("amsgrad", False):
            raise ValueError("amsgrad is not supported")
        if group.get("maximize", False):
            raise ValueError("maximize is not supported")
        beta1, beta2 = group["betas"]
        hyper = cls(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                    float(group["weight_decay"]), bool(group["adamw_mode"]))
        hyper.check()
        return hyper

    def check(self) -> None:
        if self.lr < 0.0:
            raise ValueError(f"invalid learning rate: {self.lr}")
        if self.eps < 0.0:
            raise ValueError(f"invalid eps: {self.eps}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"invalid betas: ({self.beta1}, {self.beta2})")
        if self.weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {self.weight_decay}")

    def kernel_args(self) -> dict:
        """Keyword arguments of the C++/CUDA kernels."""
        return dict(lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=self.weight_decay, adamw=self.adamw)


class AdamBase(torch.optim.Optimizer):
    """Param groups and state laid out like torch.optim.Adam/AdamW (``step``,
    ``exp_avg``, ``exp_avg_sq``), so state dicts load in either direction. ``state_dtype``: the moments'
    storage (fp32, or bf16; the arithmetic is fp32 either way)."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, adamw_mode: bool, amsgrad: bool, state_dtype: torch.dtype = torch.float32):
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"{type(self).__name__}: moments are stored in float32 or bfloat16, not {state_dtype}")
        self.state_dtype = state_dtype
        AdamHyper(lr, betas[0], betas[1], eps, weight_decay, adamw_mode).check()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, amsgrad=False, maximize=False)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # A state dict saved by torch.optim.Adam/AdamW has no adamw_mode key; torch's own flag says it.
            if "adamw_mode" not in group and "decoupled_weight_decay" in group:
                group["adamw_mode"] = bool(group["decoupled_weight_decay"])
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
        for param_state in self.state.values():
            # DeepSpeed's CPU Adam keeps step as a plain int.
            if "step" in param_state and not isinstance(param_state["step"], torch.Tensor):
                param_state["step"] = torch.tensor(float(param_state["step"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the moments keep ``state_dtype``: torch casts saved state to each param's dtype,
        and fp16 moments underflow (exp_avg_sq to 0, then NaN weights after the next step)."""
        load_state_keeping_moments(self, state_dict, super().load_state_dict, self.state_dtype)

    def _advance_state(self, param: torch.Tensor) -> tuple[dict, int]:
        """The param's state (created on first use) after counting one more step."""
        if param.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if param.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{type(self).__name__}: unsupported param dtype {param.dtype}")
        state = self.state[param]
        if not state:
            # state_dtype moments whatever the param dtype; step as a CPU float tensor,
            # the layout torch.optim.Adam uses when neither fused nor capturable.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype,
                                                memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        state["step"] += 1
        return state, int(state["step"].item())


def reference_adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper,
                         copy_to: torch.Tensor | None = None) -> None:
    """One Adam/AdamW step with torch ops, in place; ``step`` counts this update.

    The definition the kernels implement, in the order torch.optim.Adam applies
    it, computed in fp32: a 16-bit grad, param or moment is widened first and
    rounded once at the end. ``copy_to`` receives the updated param.
    """
    stored = (param, exp_avg, exp_avg_sq)
    work, exp_avg, exp_avg_sq = (t if t.dtype == torch.float32 else t.float() for t in stored)
    grad = grad.float()
    if hyper.adamw:
        work.mul_(1.0 - hyper.lr * hyper.weight_decay)
    elif hyper.weight_decay != 0.0:
        grad = grad.add(work, alpha=hyper.weight_decay)
    exp_avg.mul_(hyper.beta1).add_(grad, alpha=1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1.0 - hyper.beta2)
    bias_correction1 = 1.0 - hyper.beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - hyper.beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
    work.addcdiv_(exp_avg, denom, value=-hyper.lr / bias_correction1)
    for target, computed in zip(stored, (work, exp_avg, exp_avg_sq)):
        if computed is not target:
            target.copy_(computed)
    if copy_to is not None:
        copy_to.copy_(work)
