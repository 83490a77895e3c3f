"""fp16 loss scaling: static, or dynamic with DeepSpeed's exact schedule.

fp16 gradients underflow to zero below ~6e-8, so the loss is multiplied by a
large scale before backward and the gradients divided by it before the step.
Too large a scale overflows instead (inf/nan gradients); the step is then
skipped and the dynamic scaler backs off.

Dynamic update rule (``DynamicLossScaler.update_scale``), once per optimizer step
--------------------------------------------------------------------------------
It mirrors DeepSpeed's ``DynamicLossScaler`` (the one its ZeRO stages 1-3 use) so a
run's scale trajectory, and hence which steps are skipped, is identical at those
stages. zeroengine uses the same rule at stage 0 too; DeepSpeed's stage 0
(``FP16_Optimizer``) has its own rule that ignores ``hysteresis`` and
``consecutive_hysteresis`` and stays at ``min_loss_scale`` where this one
raises, so a stage 0 fp16 run with hysteresis > 1 skips the same steps but its
scale drops later than DeepSpeed's::

    on overflow:
        if delayed_shift == 1 or cur_hysteresis == 1:
            scale = max(scale / scale_factor, min_scale)   (error if already at min_scale)
        else:
            cur_hysteresis -= 1                            (tolerate this overflow)
        last_overflow_iter = cur_iter
    otherwise:
        if consecutive_hysteresis: cur_hysteresis = delayed_shift
        stable = cur_iter - last_overflow_iter - 1         (clean steps since the overflow, before this one)
        if stable > 0 and stable % scale_window == 0:
            if not consecutive_hysteresis: cur_hysteresis = delayed_shift
            scale *= scale_factor
    cur_iter += 1

``delayed_shift`` is the config's ``hysteresis``: the scale drops at the
``hysteresis``-th overflow (1: at the first; 2 absorbs one). With
``consecutive_hysteresis`` any clean step refills it; without, only a scale
increase does. ``last_overflow_iter`` starts at -1, so the scale first grows
on the clean step that follows
``scale_window`` clean steps, and again every ``scale_window`` steps after.
This is DeepSpeed 0.19.8's rule (the version the benchmarks compare with);
older releases tested ``(cur_iter - last_overflow_iter) % scale_window == 0``
and so grew one step sooner.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional

import torch


class LossScaleUnderflowError(RuntimeError):
    """Gradients overflowed while the loss scale was already at its minimum."""


def _positive_finite(name: str, value) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class _LossScaler:
    """What static and dynamic scalers share: applying the scale and overflow checks."""

    kind = ""

    def __init__(self, scale: float):
        self.cur_scale = scale

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def dynamic(self) -> bool:
        return self.kind == "dynamic"

    def scale_loss(self, loss):
        return loss * self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        raise NotImplementedError

    @staticmethod
    def has_overflow(tensors: Iterable[Optional[torch.Tensor]]) -> bool:
        """True if any tensor holds an inf or nan (``None`` entries are skipped).

        Each tensor is reduced to its min and max in one read-only pass
        (``aminmax`` propagates nan, and an inf is its own min or max), then a
        single host sync checks all of them. Faster on CPU than
        ``isfinite().all()`` and, unlike ``_amp_foreach_non_finite_check_and_unscale_``,
        never writes the tensors. Local only: the engine agrees across ranks.
        """
        extremes = []
        for tensor in tensors:
            if tensor is None or tensor.numel() == 0 or not tensor.is_floating_point():
                continue
            low, high = torch.aminmax(tensor.detach())
            extremes.append(low.float())
            extremes.append(high.float())
        if not extremes:
            return False
        by_device: Dict[torch.device, list] = {}
        for value in extremes:
            by_device.setdefault(value.device, []).append(value)
        return any(not bool(torch.stack(values).isfinite().all()) for values in by_device.values())

    def _check_kind(self, state: Dict[str, Any]) -> None:
        kind = state.get("kind", self.kind)
        if kind != self.kind:
            raise ValueError(f"cannot load a {kind} loss-scaler state into a {self.kind} loss scaler "
                             f"(did fp16.loss_scale change between runs?)")


class StaticLossScaler(_LossScaler):
    """A fixed loss scale (config ``fp16.loss_scale > 0``); ``update_scale`` does nothing."""

    kind = "static"

    def __init__(self, scale: float = 1.0):
        super().__init__(_positive_finite("scale", scale))

    @property
    def cur_iter(self) -> int:
        """Always 0: a static scale has no schedule to advance."""
        return 0

    def update_scale(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "cur_scale": self.cur_scale}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._check_kind(state)
        self.cur_scale = _positive_finite("cur_scale", state["cur_scale"])


class DynamicLossScaler(_LossScaler):
    """Grow the scale after ``scale_window`` clean steps, shrink it on overflow.

    The rule is in the module docstring. ``raise_error_at_min_scale`` (on, as
    in DeepSpeed) raises ``LossScaleUnderflowError`` when an overflow hits a
    scale already at ``min_scale``: every step would be skipped from then on,
    so stopping is kinder than training silently doing nothing.
    """

    kind = "dynamic"

    def __init__(self, init_scale: float = 2.0 ** 16, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1.0, delayed_shift: int = 1, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True):
        super().__init__(_positive_finite("init_scale", init_scale))
        self.scale_factor = _positive_finite("scale_factor", scale_factor)
        if self.scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        self.scale_window = _positive_int("scale_window", scale_window)
        self.min_scale = _positive_finite("min_scale", min_scale)
        if self.cur_scale < self.min_scale:
            raise ValueError(f"init_scale ({init_scale}) must be >= min_scale ({min_scale})")
        self.delayed_shift = _positive_int("delayed_shift (hysteresis)", delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_hysteresis = self.delayed_shift
        self.last_overflow_iter = -1
        self._cur_iter = 0

    @property
    def cur_iter(self) -> int:
        """Number of ``update_scale`` calls so far."""
        return self._cur_iter

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleUnderflowError(
                        f"gradients overflowed at the minimum loss scale {self.min_scale:g}; every step would "
                        f"be skipped. Lower fp16.min_loss_scale, or check the model for inf/nan.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self._cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self._cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self._cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "cur_scale": self.cur_scale, "cur_iter": self._cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore where the schedule was; the settings stay this run's config."""
        self._check_kind(state)
        missing = [k for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis") if k not in state]
        if missing:
            raise ValueError(f"dynamic loss-scaler state is missing {missing}")
        self.cur_scale = _positive_finite("cur_scale", state["cur_scale"])
        self._cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


def build_loss_scaler(fp16_enabled: bool, loss_scale: float = 0.0, initial_scale_power: int = 16,
                      loss_scale_window: int = 1000, hysteresis: int = 2, consecutive_hysteresis: bool = False,
                      min_loss_scale: float = 1.0):
    """The scaler an ``fp16`` config section asks for, or None without fp16.

    ``loss_scale == 0`` means dynamic, starting at ``2 ** initial_scale_power``;
    a positive ``loss_scale`` is a static scale. Defaults are DeepSpeed's.
    """
    if not fp16_enabled:
        return None
    loss_scale = float(loss_scale)
    if loss_scale < 0 or not math.isfinite(loss_scale):
        raise ValueError(f"fp16.loss_scale must be 0 (dynamic) or a positive number, got {loss_scale!r}")
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    if isinstance(initial_scale_power, bool) or not isinstance(initial_scale_power, int) \
            or not 0 <= initial_scale_power < 128:
        raise ValueError(f"fp16.initial_scale_power must be an integer in [0, 128), got {initial_scale_power!r}")
    return DynamicLossScaler(init_scale=2.0 ** initial_scale_power, scale_window=loss_scale_window,
                             min_scale=min_loss_scale, delayed_shift=hysteresis,
                             consecutive_hysteresis=consecutive_hysteresis)
