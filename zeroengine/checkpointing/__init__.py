"""``zeroengine.checkpointing``: DeepSpeed's name (``deepspeed.checkpointing``) for activation checkpointing,
which lives in :mod:`zeroengine.activation_checkpointing`; the same functions and the same settings.

Not to be confused with :mod:`zeroengine.checkpoint` (saving and loading training state).
"""
from zeroengine.activation_checkpointing import (
    CheckpointFunction,
    RNGStatesTracker,
    Settings,
    checkpoint,
    checkpoint_modules,
    configure,
    current,
    format_profile,
    get_cuda_rng_tracker,
    is_configured,
    is_recomputing,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    profile_report,
    reset,
    reset_profile,
    uncheckpoint_modules,
)

__all__ = [
    "CheckpointFunction", "RNGStatesTracker", "Settings", "checkpoint", "checkpoint_modules", "configure",
    "current", "format_profile", "get_cuda_rng_tracker", "is_configured", "is_recomputing",
    "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "profile_report", "reset",
    "reset_profile", "uncheckpoint_modules",
]
