"""ZeRO stages: one strategy object per stage, built by :func:`factory.build_zero_optimizer`.

Public: ``GatheredParameters`` (full stage-3 parameters inside a ``with`` block) and the
full-value helpers for sharded parameters (``safe_get_full_fp32_param`` and friends).
"""
from .full_values import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from .gathered import GatheredParameters, is_partitioned

__all__ = ["GatheredParameters", "is_partitioned", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_optimizer_state"]
