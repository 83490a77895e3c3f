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

from datetime import timedelta

import torch.distributed as dist

_HOST_TWINS: dict[object, object] = {}
_WORLD = "world"


def new_group(ranks: list[int], backend: str | None = None, timeout_s: float | None = None):
    """A process group over ``ranks`` (world ranks).

    Collective over the whole world: every rank must call it, in the same
    order and with the same ``ranks``, including ranks that are not members
    (torch.distributed's rule). Returns the group (a non-member gets a handle
    it must not use).
    """
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    group = dist.new_group(ranks=sorted(ranks), backend=backend, timeout=timeout)
    if (backend or dist.get_backend()) != "gloo":  # its host twin, made at the same collective point
        twin = dist.new_group(ranks=sorted(ranks), backend="gloo", timeout=timeout)
        _HOST_TWINS[id(group)] = (group, twin)
    return group


def host_group(group=None):
    """A gloo group over the ranks of ``group`` (the world by default), for exchanges the host decides with:
    ``group`` itself when it is gloo; None for a group made outside this module (no twin exists for it, and
    making one now would not be collective)."""
    if dist.get_backend(group) == "gloo":
        return group
    if group is None or group is dist.group.WORLD:
        if _WORLD not in _HOST_TWINS:
            _HOST_TWINS[_WORLD] = (None, dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo"))
        return _HOST_TWINS[_WORLD][1]
    entry = _HOST_TWINS.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None
