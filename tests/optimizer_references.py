"""Whole-tensor references for the optimizers zeroengine steps on ZeRO's flat pieces: SM3-II as the paper writes it,
and DeepSpeed's MuonWithAuxAdam as a single device runs it (its Newton-Schulz functions are checked against
DeepSpeed 0.19.8's own in tests/migration/test_muon_math.py)."""
import torch

from zeroengine.optim.muon import orthogonalize


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


class ReferenceMuon(torch.optim.Optimizer):
    """DeepSpeed's SingleDeviceMuonWithAuxAdam on whole tensors (groups carry use_muon), Adam decoupled, fp32
    Newton-Schulz."""

    def __init__(self, param_groups):
        super().__init__(param_groups, {})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state, g = self.state[p], p.grad
                if group["use_muon"]:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(g, 1 - group["momentum"])
                    update = orthogonalize(g.clone().lerp_(buf, group["momentum"]), group["ns_method"],
                                           dtype=torch.float32, num_heads=getattr(p, "muon_num_heads", None))
                else:
                    m = state.setdefault("exp_avg", torch.zeros_like(p))
                    v = state.setdefault("exp_avg_sq", torch.zeros_like(p))
                    state["step"] = state.get("step", 0) + 1
                    b1, b2 = group["betas"]
                    m.lerp_(g, 1 - b1)
                    v.lerp_(g.square(), 1 - b2)
                    update = (m / (1 - b1 ** state["step"])) / ((v / (1 - b2 ** state["step"])).sqrt() + group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
