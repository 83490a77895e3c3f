"""SM3 (Anil, Gupta, Koren & Singer, 2019: "Memory-Efficient Adaptive Optimization"), SM3-II, exact under ZeRO.

A tensor of shape (n_1, ..., n_k) keeps one accumulator per index of each dimension (the cover sets are the
slices along each dimension: rows and columns of a matrix), k vectors in all, instead of Adagrad's one value
per element. Each step (Algorithm SM3-II):

    nu(i)   = min_d acc_d[i_d] + g(i)^2                 (i = (i_1, ..., i_k))
    acc_d[j] = max over the elements i with i_d = j of nu(i)
    update  = g / (sqrt(nu) + eps)                      (0 where nu = 0 and eps = 0: the paper's 0/0 = 0)
    m = momentum * m + (1 - momentum) * update;  param -= lr * m     (momentum 0: the paper's step, no buffer)

A vector's cover sets are its elements: ``acc`` is then per element, and SM3 is Adagrad. ``nu`` needs only the
old accumulators, so each rank updates its own elements at once; the new accumulators are maxima over whole
slices, taken over the rank's pieces and then over the ranks in one all-reduce (MAX) per step
(:mod:`zeroengine.optim.partitioned`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .partitioned import PartitionAware, StatLayout, boxes_of

MAX_DIMS = 8


def accumulator_sizes(shape: tuple[int, ...]) -> dict[str, int]:
    """A tensor's accumulators (one per index of each dimension; none besides the per-element one for a vector),
    by state key: what the state holds and the per-step maxima lay out (state_bytes.py counts them too)."""
    return {f"acc_{d}": n for d, n in enumerate(shape)} if len(shape) > 1 else {}


class SM3(PartitionAware):
    whole_parameter_state = tuple(f"acc_{d}" for d in range(MAX_DIMS))

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.0, eps: float = 0.0):
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum should be in [0, 1) but is: {momentum}")
        if not 0.0 <= eps:
            raise ValueError(f"eps should be >= 0 but is: {eps}")
        super().__init__(params, dict(lr=lr, momentum=momentum, eps=eps))

    def _state(self, p: torch.Tensor, place, group) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if len(place.shape) > MAX_DIMS:
                raise ValueError(f"SM3 takes tensors of up to {MAX_DIMS} dimensions, got {place.shape}")
            if len(place.shape) > 1:
                for d, n in enumerate(place.shape):
                    state[f"acc_{d}"] = p.new_zeros(n, dtype=torch.float32)
            else:
                state["accumulator"] = torch.zeros_like(p, dtype=torch.float32)
            if group["momentum"] > 0:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def step_pieces(self, stepped, device) -> None:
        layout = StatLayout(self.catalog(stepped), accumulator_sizes)
        new_acc = torch.zeros(layout.numel, dtype=torch.float32, device=device)  # nu >= 0: 0 is max's identity
        for group, p, place in stepped:
            state = self._state(p, place, group)
            state["step"] += 1
            grad = p.grad.reshape(-1).float()
            if len(place.shape) > 1:
                nu = torch.empty_like(grad)
                offset = 0
                for index, box in boxes_of(grad, place):
                    cover = None
                    for d, part in enumerate(index):  # the old accumulators of this box's slices, broadcast
                        shape = [1] * len(index)
                        shape[d] = -1
                        acc = state[f"acc_{d}"][part].view(shape)
                        cover = acc if cover is None else torch.minimum(cover, acc)
                    box_nu = cover + box * box
                    for d, part in enumerate(index):
                        others = tuple(k for k in range(len(index)) if k != d)
                        seen = layout.view(new_acc, place.key, f"acc_{d}")[part]
                        torch.maximum(seen, box_nu.amax(dim=others).to(device), out=seen)
                    nu[offset:offset + box.numel()] = box_nu.reshape(-1)
                    offset += box.numel()
            else:
                nu = state["accumulator"].reshape(-1).add_(grad * grad)  # (the per-element accumulator itself)
            if group["eps"] > 0:
                update = grad / (nu.sqrt() + group["eps"])
            else:
                update = torch.where(nu > 0, grad / nu.sqrt(), torch.zeros_like(grad))
            if group["momentum"] > 0:
                buf = state["momentum_buffer"].reshape(-1)
                buf.mul_(group["momentum"]).add_(update, alpha=1 - group["momentum"])
                update = buf
            p.add_(update.view(p.shape).to(p.dtype), alpha=-group["lr"])
        self.reduce(new_acc, dist.ReduceOp.MAX)
        for group, p, place in stepped:
            for d in range(len(place.shape) if len(place.shape) > 1 else 0):
                self.state[p][f"acc_{d}"].copy_(layout.view(new_acc, place.key, f"acc_{d}"))

