"""Which buckets' optimizer state is offloaded: ``offload_optimizer.ratio`` (partial offload).

With ``ratio`` below 1, part of a rank's optimizer state stays on the
accelerator and steps there (CUDA Adam) while the CPU steps the offloaded part
(DeepSpeed's "Twin-Flow"): the model can be as large as host *plus* spare
accelerator memory allow, and the accelerator's step runs during the CPU's.

The split is by whole buckets, because a bucket is the unit the offloaded step
streams (see :mod:`zeroengine.offload.step`): the offloaded buckets are the
prefix of the layout whose share of this rank's elements is nearest to
``ratio``. Every rank's chunk of a bucket has the same size, so all ranks
choose the same buckets.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)
ROUNDING_WARNING = 0.05  # warn when the whole-bucket split is further than this from the ratio


@dataclass(frozen=True)
class OffloadPlacement:
    host_buckets: frozenset[int]  # bucket indices whose masters and optimizer state live in CPU memory
    host_numel: int
    total_numel: int

    @property
    def fraction(self) -> float:
        """The share of this rank's optimizer elements offloaded (what ``ratio`` became after rounding)."""
        return self.host_numel / self.total_numel if self.total_numel else 1.0

    def on_host(self, bucket_index: int) -> bool:
        return bucket_index in self.host_buckets


def place_buckets(chunk_numels: list[int], ratio: float) -> OffloadPlacement:
    """Offload the prefix of buckets (by their chunk sizes) whose total is nearest to ``ratio`` of all."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload ratio must be within [0, 1], got {ratio}")
    total = sum(chunk_numels)
    target = ratio * total
    host, chosen = 0, []
    for index, numel in enumerate(chunk_numels):
        if host + numel / 2 > target:  # adding this bucket would overshoot by more than it undershoots now
            break
        host += numel
        chosen.append(index)
    placement = OffloadPlacement(frozenset(chosen), host, total)
    if ratio < 1.0:
        # Buckets are the unit: with few large ones the share can land far from what was asked. Say so.
        far = abs(placement.fraction - ratio) > ROUNDING_WARNING
        (logger.warning if far else logger.info)(
            "zero_optimization.offload_optimizer.ratio %.3f: %d of %d buckets offloaded, %.3f of the optimizer "
            "state%s", ratio, len(chosen), len(chunk_numels), placement.fraction,
            " (whole buckets; a smaller zero_optimization.reduce_bucket_size gives a closer split)" if far else "")
    return placement
