"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's signatures, over
zeroengine's C++ CPU Adam and CUDA fused Adam (accelerate builds ``DeepSpeedCPUAdam`` when the config
offloads the optimizer and the script brought its own)."""
from __future__ import annotations

from zeroengine.ops.adam import CPUAdam
from zeroengine.ops.adam import FusedAdam as _FusedAdam


def _refuse(name: str, value, default) -> None:
    if value != default:
        raise ValueError(f"{name}={value!r} is not supported by zeroengine's Adam (only {default!r})")


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's CPU Adam: ``bias_correction`` and ``fp32_optimizer_states`` only True, as zeroengine's
    kernel computes (a different value is refused, not ignored)."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        _refuse("bias_correction", bias_correction, True)
        _refuse("fp32_optimizer_states", fp32_optimizer_states, True)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                         amsgrad=amsgrad)


class FusedAdam(_FusedAdam):
    """DeepSpeed's fused CUDA Adam: ``bias_correction`` only True."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        _refuse("bias_correction", bias_correction, True)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adam_w_mode,
                         amsgrad=amsgrad)
