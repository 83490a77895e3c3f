"""Where a checkpoint keeps the inputs it saves: whole, partitioned, on CPU, packed into one buffer.

``stash`` turns one input tensor into a :class:`SavedInput` according to the
settings, ``SavedInput.restore`` turns it back into a tensor on the compute
device for the recompute. The steps compose in a fixed order: partition
(keep 1/N), then move to CPU, then copy into the contiguous arena.

Contiguous arenas (``contiguous_memory_optimization``): saved inputs are
created and freed in a stack-like pattern (forward saves L of them, backward
frees them in reverse), interleaved with short-lived activations; packing them
into one preallocated buffer per (device, dtype), sized from the first segment
times ``number_checkpoints``, keeps them from fragmenting the allocator. A
segment's slot is leased until its autograd node is freed (after its backward,
or when the graph is dropped unused), and the arena rewinds once no slot is
leased. If a pass needs more than was sized, a larger buffer is started (the
old one lives on through the slots still using it) and a warning says so.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from . import partition

logger = logging.getLogger("zeroengine.checkpointing")

_CPU = torch.device("cpu")


class Arena:
    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.leases = 0

    def take(self, numel: int, slots_hint: int) -> torch.Tensor:
        if self.buffer is None or self.offset + numel > self.buffer.numel():
            if self.buffer is not None:
                logger.warning("activation_checkpointing: the contiguous buffer for %s %s (%d elements) is full; "
                               "starting a larger one (raise number_checkpoints to size it right)",
                               self.device, self.dtype, self.buffer.numel())
            capacity = max(numel * max(slots_hint, 1), 2 * self.buffer.numel() if self.buffer is not None else 0)
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            self.buffer = torch.empty(capacity, dtype=self.dtype, device=self.device, pin_memory=pin)
            self.offset = 0
        view = self.buffer[self.offset:self.offset + numel]
        self.offset += numel
        self.leases += 1
        return view

    def give_back(self) -> None:
        self.leases -= 1
        if self.leases == 0:
            self.offset = 0


_ARENAS: dict[tuple, Arena] = {}


def arena_for(device: torch.device, dtype: torch.dtype) -> Arena:
    key = (device, dtype)
    if key not in _ARENAS:
        _ARENAS[key] = Arena(device, dtype)
    return _ARENAS[key]


def arenas() -> dict[tuple, Arena]:
    return dict(_ARENAS)


def release_arenas() -> None:
    """Forget the arenas (slots still leased keep their buffer alive until their segments are freed)."""
    _ARENAS.clear()


class Lease:
    """The arena slots one checkpointed segment holds; given back after its backward (:meth:`give_back_now`),
    or when its autograd node dies without one."""

    def __init__(self):
        self._arenas: list[Arena] = []
        self._finalizer = None

    def take(self, arena: Arena, numel: int, slots_hint: int) -> torch.Tensor:
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, Lease._give_back, self._arenas)
        self._arenas.append(arena)
        return arena.take(numel, slots_hint)

    def give_back_now(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs once: a later collection of this lease gives nothing back twice

    @staticmethod
    def _give_back(taken: list[Arena]) -> None:
        for arena in taken:
            arena.give_back()


@dataclass
class SavedInput:
    data: torch.Tensor  # what is kept: the whole tensor, or this rank's flat slice; maybe on CPU
    shape: torch.Size
    device: torch.device  # where the recompute needs it
    requires_grad: bool
    partitioned: bool
    parts: int
    group: object
    # The input's version counter when ``data`` still shares its memory (no copy was made), else None:
    # an in-place change of the input before backward would silently change the recompute.
    version: int | None = None

    def restore(self) -> torch.Tensor:
        data = self.data
        if self.version is not None and data._version != self.version:
            raise RuntimeError("activation checkpointing: an input of a checkpointed function was modified in "
                               "place after its forward, and the recompute needs its saved value (as autograd "
                               "says: one of the variables needed for gradient computation has been modified "
                               "by an inplace operation); clone the input before changing it")
        if data.device != self.device:
            data = data.to(self.device, non_blocking=True)
        if self.partitioned:
            data = partition.gather_slices(data, self.shape, self.parts, self.group)
        else:
            data = data.view(self.shape)
        return data.detach().requires_grad_(self.requires_grad)


def stash(tensor: torch.Tensor, settings, lease: Lease) -> SavedInput:
    """Keep ``tensor`` for the recompute the way ``settings`` ask (see the module docstring)."""
    parts = settings.partitions
    partitioned = parts > 1 and tensor.numel() >= parts
    data = tensor.detach()
    if partitioned:
        data = partition.own_slice(data, parts, settings.mp_rank)
    if settings.cpu_checkpointing and data.device != _CPU:
        if not settings.contiguous_memory_optimization:  # (else the arena on the CPU is the copy)
            data = _to_pinned(data) if torch.cuda.is_available() else data.to(_CPU)
    if settings.contiguous_memory_optimization:
        where = _CPU if settings.cpu_checkpointing else data.device
        slot = lease.take(arena_for(where, data.dtype), data.numel(), settings.number_checkpoints or 1)
        slot.copy_(data.reshape(-1), non_blocking=True)
        data = slot
    shared = data.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    return SavedInput(data, tensor.shape, tensor.device, tensor.requires_grad, partitioned, parts,
                      settings.mp_group, version=tensor._version if shared else None)


def _to_pinned(data: torch.Tensor) -> torch.Tensor:
    out = torch.empty(data.shape, dtype=data.dtype, device=_CPU, pin_memory=True)
    out.copy_(data, non_blocking=True)
    return out
