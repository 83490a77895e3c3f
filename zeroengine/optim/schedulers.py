"""DeepSpeed's learning-rate schedules, by the same names, arguments and numbers.

A config written for DeepSpeed (``"scheduler": {"type": ..., "params": ...}``)
must give the same learning rate at every step here, so the formulas follow
``deepspeed/runtime/lr_schedules.py`` exactly, quirks included. The stepping
contract and the warmup fraction shared by the warmup family are documented
once, in ``_schedule.py``.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, Optional

from ._schedule import (
    Schedule,
    ScheduleParamError,
    Warmup,
    group_lr,
    non_negative_int,
    per_group,
    positive_int,
    unit_interval,
)
from .one_cycle import OneCycle

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "SCHEDULERS", "ScheduleParamError",
           "build_scheduler"]


class WarmupLR(Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    ``lr = min_lr + (max_lr - min_lr) * warmup_fraction(i)`` per group.
    Before the first step (i = -1) the lr is ``warmup_min_lr`` (the peak when ``warmup_num_steps`` is 0:
    no warmup).
    ``warmup_min_lr`` / ``warmup_max_lr`` may be per-group lists. The default
    ``warmup_max_lr=None`` warms up to each group's own lr (DeepSpeed >= 0.19;
    older releases defaulted to 0.001, which WarmupDecayLR still does).
    """

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self._warmup = Warmup(warmup_num_steps, warmup_type)
        self.warmup_num_steps = self._warmup.num_steps
        self.warmup_type = warmup_type
        self.min_lrs = per_group(self._groups, warmup_min_lr, "warmup_min_lr")
        if warmup_max_lr is None:
            self.max_lrs = [group_lr(g) for g in self._groups]
        else:
            self.max_lrs = per_group(self._groups, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self._apply()

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0 and self._warmup.num_steps:
            return list(self.min_lrs)
        gamma = self._gamma(self.last_batch_iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self, iteration: int) -> float:
        return self._warmup.fraction(iteration) if self._warmup.covers(iteration) else 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``.

    After warmup: ``gamma = max(0, (total - i) / max(1, total - N))``.
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        positive_int("total_num_steps", total_num_steps)
        non_negative_int("warmup_num_steps", warmup_num_steps)
        if total_num_steps < warmup_num_steps:
            raise ScheduleParamError("total_num_steps", f"total_num_steps ({total_num_steps}) must be >= "
                                     f"warmup_num_steps ({warmup_num_steps})")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if self._warmup.covers(iteration):
            return self._warmup.fraction(iteration)
        remaining = float(self.total_num_steps - max(0, iteration))  # i = -1 only without warmup: the peak
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(Schedule):
    """Warm up to each group's own lr, then cosine-decay to ``cos_min_ratio`` of it.

    The peak is the optimizer's lr at construction (``base_lrs``), and every
    value is ``base_lr * ratio``::

        warmup (i < N): ratio = warmup_min_ratio + (1 - warmup_min_ratio) * warmup_fraction(i)
        after:          p = min(1, (i - N + 1) / max(1, total - N))
                        ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)

    Before the first step the lr is 0 (the peak when ``warmup_num_steps`` is 0: no warmup). ``p`` is
    clamped so the lr stays at the floor past ``total_num_steps`` (as current DeepSpeed does).
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        positive_int("total_num_steps", total_num_steps)
        self._warmup = Warmup(warmup_num_steps, warmup_type)
        if total_num_steps < warmup_num_steps:
            raise ScheduleParamError("total_num_steps", f"total_num_steps ({total_num_steps}) must be >= "
                                     f"warmup_num_steps ({warmup_num_steps})")
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = self._warmup.num_steps
        self.warmup_type = warmup_type
        self.warmup_min_ratio = unit_interval("warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = unit_interval("cos_min_ratio", cos_min_ratio)
        self.base_lrs = [group_lr(g) for g in self._groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0 and self._warmup.num_steps:
            return 0.0
        if self._warmup.covers(i):
            return self.warmup_min_ratio + self._warmup.fraction(i) * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> List[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]

    def state_dict(self) -> Dict[str, Any]:
        # base_lrs are saved because a resumed run may build this schedule on
        # an optimizer whose lr was already moved by the schedule.
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "base_lrs" in state:  # absent in DeepSpeed checkpoints
            self.base_lrs = per_group(self._groups, list(state["base_lrs"]), "base_lrs")
        super().load_state_dict(state)


SCHEDULERS = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


def build_scheduler(type_name: str, params: Optional[dict], optimizer):
    """Build the schedule named by a DeepSpeed ``scheduler`` config section."""
    cls = SCHEDULERS.get(type_name)
    if cls is None:
        raise ValueError(f"unknown scheduler type {type_name!r}; valid types: {', '.join(SCHEDULERS)}")
    params = dict(params or {})
    signature = inspect.signature(cls.__init__).parameters
    accepted = [n for n in signature if n not in ("self", "optimizer")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"{type_name}: unknown parameter(s) {unknown}; accepted: {', '.join(accepted)}")
    missing = [n for n in accepted if signature[n].default is inspect.Parameter.empty and n not in params]
    if missing:
        raise ValueError(f"{type_name}: missing required parameter(s) {missing}")
    return cls(optimizer, **params)
