"""DeepSpeed's OneCycle schedule (lr and momentum cycled in opposite directions)."""
from __future__ import annotations

import logging
import math
from typing import List, Optional

from ._schedule import Schedule, non_negative_int, per_group, positive_int

logger = logging.getLogger(__name__)

# DeepSpeed's OneCycle writes ``betas = (momentum, 0.99)``: it replaces Adam's
# beta2 with this constant for as long as momentum is cycled. Kept for
# numerical parity with DeepSpeed runs.
ONECYCLE_BETA2 = 0.99


class OneCycle(Schedule):
    """1Cycle: lr up from ``cycle_min_lr`` to ``cycle_max_lr`` and back, then decay.

    With ``b = i + 1``, ``T = first + second`` and ``r = first / T``::

        x = b / T - floor(b / T)              (position in the cycle, 0 <= x < 1)
        s = x / r            if x <= r        (rising half)
            (x - 1) / (r - 1) otherwise       (falling half)
        lr  = min_lr + (max_lr - min_lr) * s
        mom = max_mom - (max_mom - min_mom) * s    (momentum moves opposite to lr)

    A stair count ``k > 0`` replaces ``s`` by ``floor(pos * k) / k`` where
    ``pos`` is the integer offset into that half over its length, so values
    move in ``k`` flat stairs. Once ``i >= T`` (decay phase, ``d = i - T + 1``)::

        lr  = min_lr / (1 + decay_lr_rate * d / decay_step_size)
        mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)

    with no decay (lr = min_lr, mom = max_mom) when ``decay_step_size`` or the
    rate is 0. Momentum is Adam's ``betas[0]`` (beta2 is set to
    ``ONECYCLE_BETA2``, as DeepSpeed does). As in DeepSpeed, an optimizer
    without ``betas`` (SGD, RMSprop) keeps its own momentum, with a warning:
    cycling SGD's ``momentum`` would switch momentum on for a plain SGD
    (``momentum=0``) and give other numbers than DeepSpeed. Before the
    first step the lr is ``cycle_min_lr`` and the momentum ``cycle_min_mom``
    (DeepSpeed's construction values). ``cycle_min_lr`` / ``cycle_max_lr`` and
    the momentum bounds may be per-group lists.
    """

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom=0.8,
                 cycle_max_mom=0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        first = positive_int("cycle_first_step_size", cycle_first_step_size)
        second = first if cycle_second_step_size is None else cycle_second_step_size
        non_negative_int("cycle_second_step_size", second)
        self.first_step_size = float(first)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = self._stairs("cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None else \
            self._stairs("cycle_second_stair_count", cycle_second_stair_count)
        non_negative_int("decay_step_size", decay_step_size)
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)

        self.min_lrs = per_group(self._groups, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self._groups, cycle_max_lr, "cycle_max_lr")
        self.min_moms = per_group(self._groups, cycle_min_mom, "cycle_min_mom")
        self.max_moms = per_group(self._groups, cycle_max_mom, "cycle_max_mom")
        self.cycle_momentum = bool(cycle_momentum) and self._supports_momentum()
        self._apply()

    @staticmethod
    def _stairs(name: str, value) -> int:
        return non_negative_int(name, value)

    def _supports_momentum(self) -> bool:
        if all("betas" in g for g in self._groups):
            return True
        logger.warning("OneCycle: cycle_momentum disabled, %s has no 'betas' (as in DeepSpeed, only Adam-style "
                       "beta1 is cycled; the optimizer's own momentum is left as it is)",
                       type(self.optimizer).__name__)
        return False

    def _skip_decay(self, rate: float) -> bool:
        return self.decay_step_size == 0 or math.isclose(rate, 0.0)

    def _scale_factor(self) -> float:
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset, not from `scale`, whose float
            # value can sit 1 ulp under a stair boundary.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self._skip_decay(self.decay_lr_rate):
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> Optional[list]:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < 0:
            moms = list(self.min_moms)
        elif self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            moms = [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        elif self._skip_decay(self.decay_mom_rate):
            moms = list(self.max_moms)
        else:
            factor = 1 + self.decay_mom_rate * self._decay_interval()
            moms = [hi * factor for hi in self.max_moms]
        return [(m, ONECYCLE_BETA2) for m in moms]
