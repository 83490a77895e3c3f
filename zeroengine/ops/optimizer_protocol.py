"""What torch.optim.Optimizer's protocol asks of our optimizers that its base class does not do for them.

Shared by the kernels' optimizers (ops: CPUAdam, FusedAdam) and the ones in optim (LeanAdam, the
partition-aware Adafactor, SM3 and Muon), so each rule lives once:
- ``step(closure)``: the closure runs with grad enabled inside a step that is itself ``no_grad``;
- ``load_state_dict``: moments kept in their own dtype, where torch would cast them to the parameter's.
"""
from __future__ import annotations

from typing import Callable

import torch

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def run_closure(closure: Callable[[], float] | None):
    """The loss from ``closure`` (with grad enabled, as torch optimizers do), if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def load_state_keeping_moments(optimizer: torch.optim.Optimizer, state_dict: dict,
                               load: Callable[[dict], None], dtype: torch.dtype) -> None:
    """``load`` (torch's ``Optimizer.load_state_dict``), then each saved moment stored again, from the saved
    values, in ``dtype``. torch casts saved state to each parameter's dtype first: fp32 moments of a bf16
    parameter would come back rounded to bf16, and fp16 ones underflow (exp_avg_sq to 0, then NaN weights)."""
    moments = {index: {key: value for key, value in saved.items()
                       if key in MOMENT_KEYS and isinstance(value, torch.Tensor)}
               for index, saved in state_dict["state"].items()}
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    load(state_dict)
    param_of = dict(zip(saved_ids, (p for group in optimizer.param_groups for p in group["params"])))  # as torch
    for index, saved in moments.items():
        param = param_of[index]
        for key, value in saved.items():
            optimizer.state[param][key] = value.to(device=param.device, dtype=dtype, copy=True)
