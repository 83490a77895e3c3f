"""SM3-II as the paper writes it, on whole tensors, in plain PyTorch: the reference zeroengine's SM3 (which steps
ZeRO's flat pieces, zeroengine/optim/sm3.py) is tested against."""
import torch


class ReferenceSM3(torch.optim.Optimizer):
    """SM3-II as the paper writes it, on whole tensors: one accumulator per index of each dimension (a vector's
    per element), nu = min over the element's accumulators + g^2, accumulators the max of nu over their slice."""

    def __init__(self, params, lr=0.1, momentum=0.0, eps=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                g, state = p.grad, self.state[p]
                if p.dim() == 1:
                    acc = state.setdefault("acc", torch.zeros_like(p))
                    nu = acc + g * g
                    acc.copy_(nu)
                else:
                    accs = state.setdefault("accs", [torch.zeros(n) for n in p.shape])
                    views = [a.view([-1 if k == d else 1 for k in range(p.dim())]) for d, a in enumerate(accs)]
                    cover = views[0].expand(p.shape)
                    for v in views[1:]:
                        cover = torch.minimum(cover, v.expand(p.shape))
                    nu = cover + g * g
                    for d, a in enumerate(accs):
                        a.copy_(nu.amax(dim=tuple(k for k in range(p.dim()) if k != d)))
                sqrt = nu.sqrt()
                update = g / (sqrt + group["eps"]) if group["eps"] > 0 else torch.where(nu > 0, g / sqrt, 0.0)
                if group["momentum"] > 0:
                    m = state.setdefault("m", torch.zeros_like(p))
                    update = m.mul_(group["momentum"]).add_(update, alpha=1 - group["momentum"])
                p.add_(update, alpha=-group["lr"])
