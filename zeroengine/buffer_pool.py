"""Idle 1-D buffers kept for reuse and handed out as views: what a steady training step takes instead of
allocating.

Why: a step needs the same temporaries every time (gradient buckets, reduction outputs, the staging
buffers of gloo's collectives). Allocated afresh, each is a large block that glibc keeps in its heap once
freed, so resident memory grows past the live state and fragments, and every allocation costs page faults
(``zeroengine.zero.host_memory``); an accelerator's caching allocator does the same job at a cost per call.

Policy, bounded best fit: a request gets the smallest idle buffer on its device with at least its bytes, as
a view of the requested dtype and size (buffers serve any dtype), else a new buffer of exactly its size.
At most ``keep`` idle buffers are kept: when more are given back, the largest stay, so the pool converges
to the buffers that serve every request and what it holds is bounded by ``keep`` times the largest
request, however many sizes a step uses.
"""
from __future__ import annotations

import threading

import torch


class BufferPool:
    def __init__(self, keep: int):
        self.keep = keep
        self._free: list[torch.Tensor] = []  # uint8, each over a whole storage
        self._lock = threading.Lock()  # collectives give their temporaries back from whichever thread waits

    def take(self, numel: int, dtype: torch.dtype, device, zeroed: bool = False) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (a view of an idle buffer when one is large enough)."""
        device = torch.device(device)
        nbytes = numel * dtype.itemsize
        with self._lock:
            fits = [i for i, t in enumerate(self._free) if t.device == device and _nbytes(t) >= nbytes]
            base = self._free.pop(min(fits, key=lambda i: _nbytes(self._free[i]))) if fits else None
        if base is None:
            return (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)
        view = base[:nbytes].view(dtype)
        return view.zero_() if zeroed else view

    def give(self, tensor: torch.Tensor) -> None:
        """Keep the whole memory ``tensor`` views (any view of a taken buffer) for a later request, once nothing
        reads or writes it any more."""
        # Held as bytes over the whole storage: a dtype view does not record its base (``_base`` is None).
        base = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(base)
                return
            smallest = min(range(len(self._free)), key=lambda i: _nbytes(self._free[i]))
            if _nbytes(self._free[smallest]) < _nbytes(base):
                self._free[smallest] = base

    def tensors(self) -> list[torch.Tensor]:
        """The idle buffers (memory this process holds between uses)."""
        with self._lock:
            return list(self._free)

    def held_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors())

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
