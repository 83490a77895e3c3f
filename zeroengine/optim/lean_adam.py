"""Adam/AdamW for parameters and moments stored in bf16 (``bf16.bf16_master_weights_and_grads`` and
``bf16_optimizer_states``): each step computes in fp32 and rounds each result to its storage dtype.

torch's Adam keeps its moments in the parameter's dtype and computes in it; with bf16 parameters that would
put every intermediate (the bias-corrected moments, the denominator) in bf16 as well. This one widens one
tensor at a time to fp32, runs torch's single-tensor AdamW arithmetic (the same operations in the same order,
so with fp32 storage it gives torch's numbers bitwise), and writes the parameter and each moment back rounded
to nearest: the only rounding is the storage's. Moments are kept in ``state_dtype`` (bf16: 4 bytes a
parameter for the two; fp32: DeepSpeed's default for bf16 masters, 8 bytes)."""
from __future__ import annotations

import math

import torch

from zeroengine.ops.optimizer_protocol import load_state_keeping_moments, run_closure


class LeanAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, state_dtype: torch.dtype | None = None):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.adamw_mode = adamw_mode
        self.state_dtype = state_dtype

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the moments keep ``state_dtype`` (torch would round fp32 ones to the bf16
        parameter's dtype); without one they follow the parameter's dtype, as torch's do."""
        if self.state_dtype is None:
            super().load_state_dict(state_dict)
        else:
            load_state_keeping_moments(self, state_dict, super().load_state_dict, self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    dtype = self.state_dtype or p.dtype
                    state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                state["step"] += 1
                step = float(state["step"])
                grad, value = p.grad.float(), p.float()
                exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
                if decay != 0:
                    if self.adamw_mode:
                        value.mul_(1 - lr * decay)
                    else:
                        grad = grad.add(value, alpha=decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                value.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
                for stored, computed in ((p, value), (state["exp_avg"], exp_avg), (state["exp_avg_sq"], exp_avg_sq)):
                    if stored.data_ptr() != computed.data_ptr():  # (fp32 storage: computed in place already)
                        stored.copy_(computed)
        return loss
