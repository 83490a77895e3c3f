"""``deepspeed.comm``: zeroengine's comm module (every collective counted and checked), plus the three
questions integrations ask before any collective: ``is_initialized``, ``init_distributed``,
``get_local_rank``. The collectives keep zeroengine's forms (``all_gather`` / ``reduce_scatter`` take one
flat tensor each; see docs/migrating-from-deepspeed.md)."""
from __future__ import annotations

import os

import torch.distributed as dist

from zeroengine.comm import (  # noqa: F401
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    reduce_scatter,
)

from .entry import init_distributed  # noqa: F401


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))
