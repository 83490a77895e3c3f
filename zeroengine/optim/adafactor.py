"""Adafactor (Shazeer & Stern, 2018) with ``torch.optim.Adafactor``'s semantics, exact under ZeRO partitioning.

The update of each parameter, as torch computes it (step t, ``lr``, ``beta2_decay``, ``eps = (eps1, eps2)``,
``d``, ``weight_decay``):

    rho = min(lr, 1/sqrt(t)),  alpha = max(eps2, RMS(param)) * rho,  param *= 1 - lr * weight_decay
    matrices [..., R, C]:  row_var <- lerp(row_var, mean_c g^2, t^beta2_decay)   ([..., R, 1])
                           col_var <- lerp(col_var, mean_r g^2, t^beta2_decay)   ([..., 1, C])
                           v = row_var * col_var / max(eps1, mean_r row_var)
    vectors:               v <- lerp(v, g^2, t^beta2_decay)
    u = g / sqrt(max(v, eps1^2)),  param -= alpha / max(1, RMS(u) / d) * u

Every quantity that spans the parameter (the row and column means, RMS(param), RMS(u)) is a sum over its
elements: each rank adds up its piece's part, and one all-reduce per step for the first three, one for
RMS(u), give every rank the whole parameter's (:mod:`zeroengine.optim.partitioned`). ``row_var`` and
``col_var`` are the same on every rank holding a piece (O(R + C) each); a vector's ``v`` is per element and
partitioned with it. ``u`` is computed twice (once for its norm, once to apply it) rather than kept: no
transient the size of the model.
"""
from __future__ import annotations

import math

import torch

from .partitioned import PartitionAware, StatLayout, boxes_of


def factored_sizes(shape: tuple[int, ...]) -> dict[str, int]:
    """Elements of a matrix's ([..., R, C]) row and column second moments (what the state and the per-step sums
    hold; zeroengine/optim/state_bytes.py counts them too)."""
    return {"rows": math.prod(shape[:-1]), "cols": math.prod(shape[:-2]) * shape[-1]}


def _grad_stat_sizes(shape: tuple[int, ...]) -> dict[str, int]:
    return {**(factored_sizes(shape) if len(shape) > 1 else {}), "param_sq": 1}


def _signed_grad(group, p: torch.Tensor) -> torch.Tensor:
    """The piece's gradient, flat, in fp32, negated under ``maximize``."""
    grad = p.grad.reshape(-1).float()
    return -grad if group["maximize"] else grad


def _row_col(sums: "StatLayout", flat: torch.Tensor, place) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameter's row sums ([..., R, 1]) and column sums ([..., 1, C]) in the step's statistics tensor."""
    rows = sums.view(flat, place.key, "rows").view(*place.shape[:-1], 1)
    cols = sums.view(flat, place.key, "cols").view(*place.shape[:-2], 1, place.shape[-1])
    return rows, cols


class Adafactor(PartitionAware):
    whole_parameter_state = ("row_var", "col_var")

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0, *, foreach: bool | None = None, maximize: bool = False):
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= beta2_decay:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        eps = tuple(eps)
        if len(eps) != 2 or (eps[0] is not None and not 0.0 <= eps[0]) or not 0.0 <= eps[1]:
            raise ValueError(f"eps must be a pair (eps1 >= 0 or None, eps2 >= 0), got {eps!r}")
        if not 1.0 <= d:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        # foreach is accepted for torch's signature; the step is one loop either way
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                      foreach=foreach, maximize=maximize))

    def _state(self, p: torch.Tensor, place) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if len(place.shape) > 1:
                state["row_var"] = p.new_zeros((*place.shape[:-1], 1), dtype=torch.float32)
                state["col_var"] = p.new_zeros((*place.shape[:-2], 1, place.shape[-1]), dtype=torch.float32)
            else:
                # fp32 whatever the parameter's dtype, as the factored statistics are: the gradient is widened
                state["variance"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def step_pieces(self, stepped, device) -> None:
        catalog = self.catalog(stepped)
        # 1. each piece's part of the row/column sums of g^2 and of |param|^2, then summed over the ranks
        sums = StatLayout(catalog, _grad_stat_sizes)
        flat = torch.zeros(sums.numel, dtype=torch.float32, device=device)
        for group, p, place in stepped:
            self._state(p, place)
            grad = _signed_grad(group, p)
            if len(place.shape) > 1:
                rows, cols = _row_col(sums, flat, place)
                for index, box in boxes_of(grad, place):
                    square = box * box
                    rows[index[:-1]] += square.sum(-1, keepdim=True)
                    cols[(*index[:-2], slice(None), index[-1])] += square.sum(-2, keepdim=True)
            values = p.reshape(-1).float()
            sums.view(flat, place.key, "param_sq").add_(torch.dot(values, values))
        self.reduce(flat)
        # 2. the factored (or per-element) second moments, and each piece's part of |u|^2
        norms = StatLayout(catalog, lambda shape: {"update_sq": 1})
        update_sq = torch.zeros(norms.numel, dtype=torch.float32, device=device)
        for group, p, place in stepped:
            state = self._state(p, place)
            state["step"] += 1
            decay = float(state["step"]) ** group["beta2_decay"]
            if len(place.shape) > 1:
                rows, cols = _row_col(sums, flat, place)
                state["row_var"].lerp_(rows.to(state["row_var"].device) / place.shape[-1], decay)
                state["col_var"].lerp_(cols.to(state["col_var"].device) / place.shape[-2], decay)
            else:
                grad = _signed_grad(group, p).view(p.shape)
                state["variance"].lerp_(grad * grad, decay)
            u = self._update(group, p, place, state)
            norms.view(update_sq, place.key, "update_sq").add_(torch.dot(u, u).to(device))
        self.reduce(update_sq)
        # 3. apply: alpha from the parameter's RMS before the decay, the update clipped by its RMS
        for group, p, place in stepped:
            state = self.state[p]
            numel = math.prod(place.shape)
            lr, eps2 = group["lr"], group["eps"][1]
            rho = min(lr, 1 / float(state["step"]) ** 0.5)
            param_rms = float(sums.view(flat, place.key, "param_sq")) ** 0.5 / numel ** 0.5
            alpha = max(eps2, param_rms) * rho
            denom = max(1.0, float(norms.view(update_sq, place.key, "update_sq")) ** 0.5 / (numel ** 0.5 * group["d"]))
            if group["weight_decay"] != 0:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(self._update(group, p, place, state).view(p.shape).to(p.dtype), alpha=-alpha / denom)

    def _update(self, group, p, place, state) -> torch.Tensor:
        """u = g / sqrt(max(v, eps1^2)) for the piece's elements, flat, from the current state."""
        eps1 = group["eps"][0]
        if eps1 is None:
            eps1 = torch.finfo(p.dtype).eps
        grad = _signed_grad(group, p)
        if len(place.shape) <= 1:
            return state["variance"].reshape(-1).clamp(min=eps1 * eps1).rsqrt_().mul_(grad)
        row_var, col_var = state["row_var"], state["col_var"]
        row_mean = row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)  # [..., 1, 1]
        u = torch.empty_like(grad)
        offset = 0
        for index, box in boxes_of(grad, place):
            v = row_var[index[:-1]] * col_var[(*index[:-2], slice(None), index[-1])]
            v = v.div_(row_mean[(*index[:-2], slice(None), slice(None))])
            n = box.numel()
            u[offset:offset + n] = v.clamp_(min=eps1 * eps1).rsqrt_().mul_(box).reshape(-1)
            offset += n
        return u
