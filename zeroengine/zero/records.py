"""Where each parameter lives under ZeRO stages 1-3: one record per parameter, found with :func:`record_of`.

The factory records every parameter a ZeRO buffer holds as it builds the stage: its buffer (flat at stages
1-2, partitioned at stage 3), bucket, slot in the bucket, and the sharded optimizer that steps it (none for
a frozen stage-3 parameter). ``GatheredParameters``, the ``safe_get_full_*`` helpers and ``is_partitioned``
ask here instead of searching buffers and layouts, or telling stages apart by the buffer's class.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .layout import Bucket, ParamSlot


@dataclass(frozen=True)
class ParamRecord:
    buffer: object  # the ParamBuffer holding the parameter
    bucket: Bucket
    slot: ParamSlot
    owner: object | None  # the ShardedOptimizer that steps it; None: frozen (stage 3)

    @property
    def partitioned(self) -> bool:
        """Stage 3: a rank holds only its chunks, and the parameter its full value only while gathered."""
        return self.buffer.partitioned

    @property
    def shape(self) -> torch.Size:
        return self.buffer.full_shape(self.slot.index)


# id(parameter) -> (a weak reference to it, its record). Keyed by id: tensors compare elementwise.
_RECORDS: dict[int, tuple[weakref.ref, ParamRecord]] = {}


def record_buffer(buffer, owner) -> None:
    """Record every parameter ``buffer`` holds, stepped by ``owner`` (None: frozen)."""
    for bucket in buffer.layout.buckets:
        for slot in bucket.slots:
            param = buffer.params[slot.index]
            key = id(param)
            _RECORDS[key] = (weakref.ref(param, lambda _ref, key=key: _RECORDS.pop(key, None)),
                             ParamRecord(buffer, bucket, slot, owner))


def record_of(param: torch.Tensor) -> ParamRecord | None:
    """Where ``param`` lives, or None for a parameter no ZeRO buffer holds (stage 0, not in an engine)."""
    entry = _RECORDS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]
