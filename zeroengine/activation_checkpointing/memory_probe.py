"""Peak live tensor bytes, measured on any device (the CPU has no allocator statistics).

``with LiveTensorBytes() as probe: ...`` watches every tensor an operator
creates inside the block (forward, backward and recompute alike) and follows
its storage's lifetime, so ``probe.peak[device_type]`` is the most bytes that
were alive at once, counting only storages created inside the block (parameters
and inputs made before it are the baseline, not counted). Views and in-place
results share their input's storage and add nothing, as in an allocator.
On CUDA it agrees with ``torch.cuda.max_memory_allocated`` up to the caching
allocator's rounding; on CPU it is what that statistic would be.
"""
from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self._alive: dict[tuple[str, int], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, nbytes = _key(t), storage.nbytes()
        if nbytes == 0 or key in inputs or key in self._alive:
            return
        self._alive[key] = nbytes
        self.live[key[0]] += nbytes
        self.peak[key[0]] = max(self.peak[key[0]], self.live[key[0]])
        # Storages keep their Python object alive as long as any tensor uses them, so this fires
        # exactly when the memory would be returned to the allocator.
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key) -> None:
        nbytes = self._alive.pop(key, None)
        if nbytes is not None:
            self.live[key[0]] -= nbytes

    def reset_peak(self) -> None:
        for device in list(self.peak):
            self.peak[device] = self.live[device]


def _key(t: torch.Tensor) -> tuple[str, int]:
    return t.device.type, t.untyped_storage().data_ptr()
