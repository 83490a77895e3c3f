"""fp32 master copies of 16-bit parameters (the tensors the optimizer updates)."""
from __future__ import annotations

import torch


class MasterWeights:
    """Pairs each 16-bit model parameter with an fp32 master.

    The masters are cloned from the fp32 values *before* the module is cast to
    16 bits, so the first step starts from the exact initial weights rather
    than their rounded copies.
    """

    def __init__(self, model_params: list[torch.nn.Parameter], fp32_values: list[torch.Tensor]):
        self.model_params = model_params
        self.masters = [
            torch.nn.Parameter(v.detach().clone().to(torch.float32), requires_grad=p.requires_grad)
            for p, v in zip(model_params, fp32_values)
        ]
        self.master_of = {id(p): m for p, m in zip(model_params, self.masters)}

    @torch.no_grad()
    def load_grads(self, inv_scale: float = 1.0) -> None:
        """Copy (and unscale) the 16-bit model grads into fp32 master grads."""
        for p, m in zip(self.model_params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            g = p.grad.to(torch.float32)
            if inv_scale != 1.0:
                g.mul_(inv_scale)
            m.grad = g

    @torch.no_grad()
    def write_back(self) -> None:
        """Refresh the 16-bit model weights from the updated masters."""
        for p, m in zip(self.model_params, self.masters):
            p.data.copy_(m.data)

    def zero_grad(self) -> None:
        for m in self.masters:
            m.grad = None
