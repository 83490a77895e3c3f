"""Process-group creation (the sub-groups features such as expert parallelism need)."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def new_group(ranks: list[int], backend: str | None = None, timeout_s: float | None = None):
    """A process group over ``ranks`` (world ranks).

    Collective over the whole world: every rank must call it, in the same
    order and with the same ``ranks``, including ranks that are not members
    (torch.distributed's rule). Returns the group (a non-member gets a handle
    it must not use).
    """
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    return dist.new_group(ranks=sorted(ranks), backend=backend, timeout=timeout)

