"""FusedAdam: Adam/AdamW for CUDA params, many tensors per kernel launch."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import torch

from zeroengine.ops._adam_common import AdamBase, AdamHyper
from zeroengine.ops.builder import load_kernel
from zeroengine.ops.op_builders import FusedAdamBuilder
from zeroengine.ops.optimizer_protocol import run_closure


class FusedAdam(AdamBase):
    """Adam (``adamw_mode=False``) or AdamW; results and state dicts match
    torch.optim.Adam / torch.optim.AdamW.

    CUDA params (fp32, bf16 or fp16; moments always fp32) are updated by the
    multi-tensor kernel of ops/csrc/adam/fused_adam.cu, one launch per
    (device, dtype, step count) bucket. When that op cannot be built, and for
    params on other devices, torch's own fused Adam/AdamW kernel runs instead
    (after one warning when the op is missing). ``impl="cuda"`` insists on the
    op, ``impl="torch"`` never uses it. ``backend`` is ``"cuda"`` or ``"torch-fused"``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                 amsgrad: bool = False, *, impl: str = "auto"):
        if impl not in ("auto", "cuda", "torch"):
            raise ValueError(f"impl must be 'auto', 'cuda' or 'torch', got {impl!r}")
        super().__init__(params, lr, betas, eps, weight_decay, adamw_mode, amsgrad)
        self._kernel = None if impl == "torch" else _load_kernel(required=impl == "cuda")
        self.backend = "cuda" if self._kernel else "torch-fused"

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = run_closure(closure)
        for group in self.param_groups:
            multi_tensor_step(self, [p for p in group["params"] if p.grad is not None], AdamHyper.from_group(group),
                              self._kernel)
        return loss


def multi_tensor_step(optimizer: AdamBase, params: list[torch.Tensor], hyper: AdamHyper, kernel) -> None:
    """Step ``params`` (all with a .grad) of one param group of ``optimizer``: one kernel launch per
    (device, dtype, step count) bucket, the CUDA op when ``kernel`` is given, else torch's fused kernel."""
    buckets: dict[tuple, list[tuple]] = defaultdict(list)
    for param in params:
        state, step = optimizer._advance_state(param)
        key = (param.device, param.dtype, step)
        buckets[key].append((param, param.grad, state["exp_avg"], state["exp_avg_sq"]))
    for (device, _, step), tensors in buckets.items():
        params, grads, exp_avgs, exp_avg_sqs = (list(column) for column in zip(*tensors))
        if kernel is not None and device.type == "cuda" and all(t.is_contiguous() for t in params) and all(
                m.dtype == torch.float32 for m in exp_avgs):
            grads = [g.contiguous() for g in grads]
            kernel.fused_adam(params, grads, exp_avgs, exp_avg_sqs, step, **hyper.kernel_args())
        else:
            _torch_fused_step(params, grads, exp_avgs, exp_avg_sqs, step, hyper)


def _torch_fused_step(params: list[torch.Tensor], grads: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], step: int,
                      hyper: AdamHyper) -> None:
    """torch's fused kernel (CUDA; CPU since torch 2.4) on one bucket.

    That kernel wants one dtype for params and moments, so 16-bit params and
    moments are updated through fp32 copies and rounded back once.
    """
    stored = [*params, *exp_avgs, *exp_avg_sqs]
    widened = [t if t.dtype == torch.float32 else t.float() for t in stored]
    count = len(params)
    work, exp_avgs, exp_avg_sqs = widened[:count], widened[count:2 * count], widened[2 * count:]
    grads = [g.float() for g in grads]
    # The kernel reads the already-incremented step from a tensor on the params' device.
    steps = [torch.tensor(float(step), device=params[0].device)] * len(params)
    fused = torch._fused_adamw_ if hyper.adamw else torch._fused_adam_
    fused(work, grads, exp_avgs, exp_avg_sqs, [], steps, lr=hyper.lr, beta1=hyper.beta1,
          beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False,
          maximize=False)
    for target, updated in zip(stored, widened):
        if updated is not target:
            target.copy_(updated)


def _load_kernel(required: bool):
    return load_kernel(FusedAdamBuilder(), required, "FusedAdam", "torch's fused Adam kernel")


def load_cuda_kernel():
    """The CUDA op for another optimizer's device params (CPUAdam under partial offload), or None."""
    return _load_kernel(required=False)
