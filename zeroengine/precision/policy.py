"""Which dtype the model computes in, and whether an fp32 master copy exists."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    """The precision a run trains in, decided once from the config.

    ``param_dtype`` is what the module's parameters (and so forward, backward
    and the gradients) use. In 16-bit training the optimizer never sees those
    parameters: it updates an fp32 master copy, because bf16/fp16 cannot
    represent small updates (bf16 has an 8-bit mantissa: adding 1e-4 to 1.0 is
    a no-op), and the 16-bit weights are refreshed from the masters after
    each step.
    """

    param_dtype: torch.dtype = torch.float32
    # fp16.auto_cast: cast floating-point inputs of forward to fp16 (as DeepSpeed: off by default, never
    # under bf16), through lists, tuples and dicts. Off, inputs reach the model as given.
    auto_cast: bool = False
    # bf16.bf16_master_weights_and_grads: the optimizer steps the bf16 parameters themselves (no fp32 copy)
    master_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def separate_masters(self) -> bool:
        """Whether the optimizer steps an fp32 copy of 16-bit parameters (else the parameters themselves)."""
        return self.mixed and self.master_dtype == torch.float32

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.param_dtype]

    def cast_input(self, value):
        """With ``auto_cast``, floating-point tensors in ``value`` become fp16 (integer token ids are
        untouched); otherwise ``value`` itself."""
        if not self.auto_cast:
            return value
        if isinstance(value, (list, tuple)):
            cast = [self.cast_input(v) for v in value]
            return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
        if isinstance(value, dict):
            return {k: self.cast_input(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(torch.float16)
        return value
