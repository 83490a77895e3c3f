"""Optimizers and learning-rate schedules built from DeepSpeed-style config sections."""
from zeroengine.optim.factory import OPTIMIZER_NAMES, build_optimizer
from zeroengine.optim.schedulers import (
    SCHEDULERS,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = ["OPTIMIZER_NAMES", "SCHEDULERS", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_optimizer", "build_scheduler"]
