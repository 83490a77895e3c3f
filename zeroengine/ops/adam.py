"""Adam/AdamW optimizers backed by zeroengine's ops: ``CPUAdam`` (C++, for
CPU-resident and offloaded optimizer state) and ``FusedAdam`` (CUDA)."""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from zeroengine.ops._adam_common import AdamBase, AdamHyper, reference_adam_step
from zeroengine.ops.builder import load_kernel
from zeroengine.ops.fused_adam import FusedAdam, load_cuda_kernel, multi_tensor_step
from zeroengine.ops.op_builders import CPUAdamBuilder
from zeroengine.ops.optimizer_protocol import run_closure

__all__ = ["CPUAdam", "FusedAdam"]

_COPY_DTYPES = (torch.bfloat16, torch.float16)
_NOT_LOADED = object()


class CPUAdam(AdamBase):
    """Adam (``adamw_mode=False``) or AdamW on CPU tensors; results match
    torch.optim.Adam / torch.optim.AdamW, and so do the state dicts.

    Runs the C++ kernel (ops/csrc/adam/cpu_adam.cpp: SIMD and OpenMP, one pass
    over memory) when it builds, else the PyTorch reference step after one
    warning. ``impl="cpp"`` insists on the kernel (raising if it cannot be
    built), ``impl="torch"`` never uses it. ``backend`` names what runs:
    ``"cpp-avx512"``, ``"cpp-avx2"``, ``"cpp-scalar"`` or ``"torch"``.

    The kernel takes contiguous fp32 params (master weights) with fp32 moments,
    and bf16 params with fp32 or bf16 moments (``state_dtype``: the lean modes,
    ``bf16.bf16_master_weights_and_grads`` with offload); any other param gets
    the reference step. Moments are ``state_dtype`` whatever the param dtype.

    Params on an accelerator (the buckets partial offload, ``offload_optimizer.ratio``,
    keeps there) are stepped where they are, by FusedAdam's multi-tensor step,
    so one optimizer (one set of param groups, one state dict) covers both.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                 amsgrad: bool = False, *, impl: str = "auto", state_dtype: torch.dtype = torch.float32):
        if impl not in ("auto", "cpp", "torch"):
            raise ValueError(f"impl must be 'auto', 'cpp' or 'torch', got {impl!r}")
        super().__init__(params, lr, betas, eps, weight_decay, adamw_mode, amsgrad, state_dtype)
        self._kernel = None if impl == "torch" else _load_kernel(required=impl == "cpp")
        self._device_kernel = _NOT_LOADED  # FusedAdam's CUDA op, loaded when a CUDA param first steps
        self.backend = f"cpp-{self._kernel.simd_level()}" if self._kernel else "torch"

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *,
             copy_to: Mapping[torch.Tensor, torch.Tensor] | None = None):
        """One optimizer step; see ``step_with_copy`` for ``copy_to``."""
        loss = run_closure(closure)
        copy_to = copy_to or {}
        for group in self.param_groups:
            hyper = AdamHyper.from_group(group)
            on_device = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.device.type == "cpu":
                    self._update(param, hyper, copy_to.get(param))
                else:
                    on_device.append(param)
            if on_device:
                self._step_on_device(on_device, hyper, copy_to)
        return loss

    def _step_on_device(self, params: list[torch.Tensor], hyper: AdamHyper, copy_to: Mapping) -> None:
        if any(p in copy_to for p in params):
            raise ValueError("copy targets are for CPU params; a param on an accelerator is updated in place")
        if self._device_kernel is _NOT_LOADED:
            self._device_kernel = load_cuda_kernel() if any(p.device.type == "cuda" for p in params) else None
        multi_tensor_step(self, params, hyper, self._device_kernel)

    def step_with_copy(self, copy_to: Mapping[torch.Tensor, torch.Tensor],
                       closure: Callable[[], float] | None = None):
        """``step()`` that also writes each updated param into ``copy_to[param]``.

        A target is a contiguous bf16 or fp16 CPU tensor with the param's numel
        (e.g. the pinned buffer the engine copies to the GPU); the kernel fills
        it in the same pass that updates the param. Params without a grad are
        neither updated nor copied. Goes through ``step`` so optimizer hooks
        and LR-scheduler bookkeeping see it.
        """
        return self.step(closure, copy_to=copy_to)

    def _update(self, param: torch.Tensor, hyper: AdamHyper, copy_to: torch.Tensor | None) -> None:
        if copy_to is not None:
            _check_copy_target(param, copy_to)
        state, step = self._advance_state(param)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if self._kernel is not None and _kernel_takes(param, exp_avg) and all(
                t.is_contiguous() for t in (param, exp_avg, exp_avg_sq)):
            self._kernel.adam_step(param, param.grad.contiguous(), exp_avg, exp_avg_sq, copy_to,
                                   step, **hyper.kernel_args())
        else:
            reference_adam_step(param, param.grad, exp_avg, exp_avg_sq, step, hyper, copy_to)


def _kernel_takes(param: torch.Tensor, exp_avg: torch.Tensor) -> bool:
    """The dtypes cpu_adam.cpp is built for: fp32 masters with fp32 moments, bf16 ones with either."""
    if param.dtype == torch.float32:
        return exp_avg.dtype == torch.float32
    return param.dtype == torch.bfloat16 and param.grad.dtype in (torch.float32, torch.bfloat16)


def _check_copy_target(param: torch.Tensor, target: torch.Tensor) -> None:
    if target.dtype not in _COPY_DTYPES or target.device.type != "cpu" or not target.is_contiguous():
        raise ValueError("copy target must be a contiguous bfloat16 or float16 CPU tensor, "
                         f"got {target.dtype} on {target.device}")
    if target.numel() != param.numel():
        raise ValueError(f"copy target has {target.numel()} elements, param has {param.numel()}")


def _load_kernel(required: bool):
    return load_kernel(CPUAdamBuilder(), required, "CPUAdam", "the slower PyTorch reference step")
