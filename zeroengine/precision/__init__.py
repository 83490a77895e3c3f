"""Numeric precision: the training dtype policy, fp32 master weights and fp16 loss scaling."""
from zeroengine.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    build_loss_scaler,
)

__all__ = ["DynamicLossScaler", "LossScaleUnderflowError", "StaticLossScaler", "build_loss_scaler"]
