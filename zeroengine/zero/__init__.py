"""ZeRO stages: one strategy object per stage, built by :func:`factory.build_zero_optimizer`.

Public: ``Init`` (build a model with its parameters partitioned from the start),
``GatheredParameters`` (full stage-3 parameters inside a ``with`` block), the full-value
helpers for sharded parameters (``safe_get_full_fp32_param`` and friends),
``register_external_parameter`` (a module that uses another module's parameter), and the error a
partitioned parameter raises when used outside the engine (``PartitionedParameterError``).
"""
from .external import register_external_parameter, unregister_external_parameter
from .full_values import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from .gathered import GatheredParameters, is_partitioned
from .init import Init
from .param_guard import PartitionedParameterError

__all__ = ["GatheredParameters", "Init", "PartitionedParameterError", "is_partitioned", "register_external_parameter",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param",
           "safe_set_full_optimizer_state", "unregister_external_parameter"]
