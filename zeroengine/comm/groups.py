"""Process-group creation (the sub-groups features such as expert parallelism need), and each group's host twin.

Note: host twins.
Some exchanges are bookkeeping the host decides with (which gradient buckets
got late contributions on some rank): a few integers. On an NCCL group they
would be device collectives followed by a copy to the host, which waits for
all the device work queued before it: a host-device synchronisation each
time. So every NCCL group made here gets a gloo *twin* over the same ranks,
where such exchanges run on the host alone (:func:`host_group`). The twin is
made at the same moment as its group (group creation is collective: every
rank must make the same groups in the same order); the world's twin is made
on first use, which every rank reaches at the same collective call.
"""
from __future__ import annotations

import weakref
from datetime import timedelta

import torch.distributed as dist


class WorldScoped(dict):
    """A cache of things made in one world: process groups, and the meshes and layouts that hold them.

    A process group outlives nothing: once torch.distributed's default group is destroyed (``comm.shutdown``,
    or a framework's own ``destroy_process_group`` between two ``trainer.fit`` calls in a notebook) every group
    made in it is dead. So each cache remembers the default group its entries were made in, by reference
    (an ``id()`` can be reused by the next world's group), and empties itself when the current one is
    another; :func:`forget_world` (called by ``comm.shutdown``) empties every cache at once. Read it through
    :meth:`current`."""

    _all: "weakref.WeakSet[WorldScoped]" = weakref.WeakSet()

    def __init__(self):
        super().__init__()
        self._world = None
        WorldScoped._all.add(self)

    def __hash__(self):  # (members of a WeakSet; a cache is its own identity)
        return id(self)

    def current(self) -> "WorldScoped":
        world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        if world is not self._world:
            self.clear()
            self._world = world
        return self


def forget_world() -> None:
    """Empty every :class:`WorldScoped` cache (the world is being torn down)."""
    for cache in list(WorldScoped._all):
        cache.clear()
        cache._world = None


_HOST_TWINS = WorldScoped()
_WORLD = "world"


def new_group(ranks: list[int], backend: str | None = None, timeout_s: float | None = None,
              host_twin: bool = True):
    """A process group over ``ranks`` (world ranks).

    Collective over the whole world: every rank must call it, in the same
    order and with the same ``ranks``, including ranks that are not members
    (torch.distributed's rule). Returns the group (a non-member gets a handle
    it must not use). ``host_twin=False``: a group that only ever carries
    point-to-point messages needs no gloo twin (see the note above).
    """
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    group = dist.new_group(ranks=sorted(ranks), backend=backend, timeout=timeout)
    if host_twin and (backend or dist.get_backend()) != "gloo":  # its host twin, made at the same collective point
        twin = dist.new_group(ranks=sorted(ranks), backend="gloo", timeout=timeout)
        _HOST_TWINS.current()[id(group)] = (group, twin)
    return group


def host_group(group=None):
    """A gloo group over the ranks of ``group`` (the world by default), for exchanges the host decides with:
    ``group`` itself when it is gloo; None for a group made outside this module (no twin exists for it, and
    making one now would not be collective)."""
    if dist.get_backend(group) == "gloo":
        return group
    twins = _HOST_TWINS.current()
    if group is None or group is dist.group.WORLD:
        if _WORLD not in twins:
            twins[_WORLD] = (None, dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo"))
        return twins[_WORLD][1]
    entry = twins.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def destroy_group(group) -> None:
    """Destroy ``group`` (one made by :func:`new_group`, not the world: that is :func:`zeroengine.comm.shutdown`)
    and its host twin. Every member calls it once it is done with the group."""
    twins = _HOST_TWINS.current()
    entry = twins.pop(id(group), None)
    dist.destroy_process_group(group)
    if entry is not None and entry[0] is group:
        dist.destroy_process_group(entry[1])
