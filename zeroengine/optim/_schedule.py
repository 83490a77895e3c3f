"""What every DeepSpeed-style schedule shares: stepping, optimizer writes, state.

Stepping contract
-----------------
``last_batch_iteration`` is the number of ``step()`` calls so far minus one:
-1 before training, and the engine calls ``step()`` once after each optimizer
step. Construction writes the value for ``last_batch_iteration`` into the
optimizer, so the first optimizer step runs with the i = -1 value and the
(i + 2)-th optimizer step with the value at iteration i. This is DeepSpeed's
order, and matching it is what makes learning rates agree step for step.

Warmup fraction (WarmupLR, WarmupDecayLR, WarmupCosineLR)
---------------------------------------------------------
With ``N = max(2, warmup_num_steps)`` (DeepSpeed clamps to 2 so log(N) > 0)
and iteration ``0 <= i < N``::

    log:    log(i + 1) / log(N)
    linear: i / N

and 1 once ``i >= N``. ``warmup_num_steps = 0`` means no warmup (1 from the
first step; what HuggingFace's ``"auto"`` asks for when the Trainer has no
warmup). DeepSpeed 0.19.8 refuses 0, and older versions clamped it to 2,
which holds the lr at ``warmup_min_lr`` for the first two steps.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


class ScheduleParamError(ValueError):
    """A bad schedule parameter; ``param`` names it (initialize reports ``scheduler.params.<param>``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def param_groups_owner(optimizer):
    """The object whose ``param_groups`` the schedule writes.

    Anything exposing ``param_groups`` works (a torch optimizer, or a ZeRO
    wrapper that forwards them); otherwise an ``.optimizer`` attribute is
    tried, as DeepSpeed does for its wrappers.
    """
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass a torch.optim.Optimizer")


def per_group(groups: Sequence[dict], value, name: str) -> List[float]:
    """Broadcast a scalar to every param group, or check a per-group list."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ScheduleParamError(name, f"{name}: expected {len(groups)} values (one per param group), "
                                     f"got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * len(groups)


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ScheduleParamError(name, f"{name} must be a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScheduleParamError(name, f"{name} must be a non-negative integer, got {value!r}")
    return value


def unit_interval(name: str, value) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ScheduleParamError(name, f"{name} must be in [0, 1], got {value!r}")
    return value


def group_lr(group: dict) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


class Warmup:
    """The warmup fraction documented in the module docstring."""

    def __init__(self, num_steps, warmup_type: str):
        # 0 is no warmup (HF's "auto" gives it); 1 is clamped to 2, as DeepSpeed does.
        non_negative_int("warmup_num_steps", num_steps)
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        self.num_steps = max(2, num_steps) if num_steps else 0
        self.type = warmup_type
        # Multiplying by a precomputed inverse (not dividing) keeps the
        # floats bit-identical to DeepSpeed's.
        self._inverse_log = 1.0 / math.log(self.num_steps) if self.num_steps else 0.0

    def covers(self, iteration: int) -> bool:
        return 0 <= iteration < self.num_steps

    def fraction(self, iteration: int) -> float:
        if self.type == "log":
            return self._inverse_log * math.log(iteration + 1)
        return iteration / self.num_steps


class Schedule:
    """Stepping, optimizer writes and checkpoint state shared by all schedules.

    Subclasses compute values only: ``get_lr()`` (and, for OneCycle,
    ``get_mom()``) as pure functions of ``last_batch_iteration``.
    """

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = param_groups_owner(optimizer)
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise ValueError(f"last_batch_iteration must be an integer >= -1, got {last_batch_iteration!r}")
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: List[float] = []

    @property
    def _groups(self) -> List[dict]:
        return self.optimizer.param_groups

    def get_lr(self) -> List[float]:
        raise NotImplementedError

    def get_mom(self) -> Optional[list]:
        """Per-group momentum to write, or None when this schedule leaves it alone."""
        return None

    def get_last_lr(self) -> List[float]:
        """The learning rates most recently written to the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance one optimizer step (or jump to ``last_batch_iteration``)."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the position and re-write that step's values to the optimizer.

        DeepSpeed only restores the counter and relies on the optimizer's own
        checkpoint for the current lr; writing it here also makes a resume
        with ``load_optimizer_states=False`` continue on schedule.
        """
        if "last_batch_iteration" not in state:
            raise ValueError(f"{type(self).__name__} state_dict has no 'last_batch_iteration' "
                             f"(keys: {sorted(state)})")
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self._groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr a tensor (capturable / compiled steps)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)
        moms = self.get_mom()
        if moms is not None:
            for group, mom in zip(self._groups, moms):
                group["betas"] = mom
