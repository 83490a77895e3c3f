"""Reusable staging buffers for collectives that need a temporary as large as their message.

On gloo, zeroengine builds reduce-scatter and all-gather from all_to_all_single
(see ``collectives._use_all_to_all``), which needs a full-size temporary per
call: the received chunks before they are summed, or this rank's chunk
repeated once per peer. Stage 3 issues such a call for every bucket in
forward, again in backward, and once more per gradient bucket, so allocating
each temporary afresh handed glibc a stream of equal-sized large blocks that
it keeps in its heap (resident memory grew well past the live state; see
``zeroengine.zero.host_memory``) and cost an allocation and page faults per
call. A buffer is taken here and given back once its collective has
completed, so each size is allocated about once per concurrently running
collective.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

_KEEP_PER_SIZE = 4  # more idle buffers of one size than this are dropped (a burst of prefetches)


class ScratchPool:
    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # given back from whichever thread waits on the collective

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, device)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, tensor: torch.Tensor) -> None:
        key = (tensor.numel(), tensor.dtype, tensor.device)
        with self._lock:
            free = self._free[key]
            if len(free) < _KEEP_PER_SIZE:
                free.append(tensor)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def held_tensors(self) -> list[torch.Tensor]:
        """The idle buffers kept for reuse (memory this process holds between collectives)."""
        with self._lock:
            return [t for free in self._free.values() for t in free]

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held_tensors())


scratch = ScratchPool()
