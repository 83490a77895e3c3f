"""Agreeing how a piece of work ended on every rank, before the collectives that follow it.

A rank whose work raises and leaves would hang its peers in the next collective it never joins, until the
comm timeout, with nothing said about why. So work that may fail on some ranks only (a pipeline schedule:
one stage's data iterator runs out, its loss is not a scalar) ends at :func:`agree_outcome`: every rank
joins it however its work ended, and all learn whether, where and why it failed. On success it costs one
small control all-gather (a status per rank, on the host group: no device synchronisation); only on
failure do the ranks exchange their error messages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .backend import device_for_backend, get_rank, get_world_size
from .collectives import control_all_gather
from .groups import host_group

OK, STOPPED, FAILED = 0, 1, 2  # stopped: the work could not go on because another rank failed
MESSAGE_BYTES = 1024


@dataclass(frozen=True)
class Failure:
    rank: int  # global rank
    message: str


def agree_outcome(status: int, message: str = "", group=None) -> list[Failure]:
    """Collective over ``group`` (the world by default): every rank's ``status`` (OK, STOPPED or FAILED, with
    ``message`` saying why when FAILED). Returns the ranks that FAILED, lowest first; empty when none did
    (STOPPED ranks were stopped by those, so they are not listed)."""
    world = get_world_size(group)
    if world == 1:
        return [Failure(get_rank(), message)] if status == FAILED else []
    host, device = host_group(group), torch.device("cpu")
    if host is None and group is not None and group is not dist.group.WORLD and dist.get_backend(group) != "gloo":
        host, device = group, device_for_backend()  # a device group made outside zeroengine: no host twin
    mine = torch.tensor([status], dtype=torch.int64, device=device)
    statuses = torch.empty(world, dtype=torch.int64, device=device)
    control_all_gather(statuses, mine, host)
    if not bool(statuses.ne(OK).any()):
        return []
    statuses = statuses.cpu()
    encoded = torch.zeros(MESSAGE_BYTES + 8, dtype=torch.uint8)
    text = message.encode("utf-8", errors="replace")[:MESSAGE_BYTES]
    encoded[:8] = torch.tensor([get_rank()], dtype=torch.int64).view(torch.uint8)
    encoded[8:8 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else encoded[8:8]
    gathered = torch.empty(world, MESSAGE_BYTES + 8, dtype=torch.uint8, device=device)
    control_all_gather(gathered.view(-1), encoded.to(device), host)
    gathered = gathered.cpu()
    failures = []
    for i in range(world):
        if int(statuses[i]) == FAILED:
            rank = int(gathered[i, :8].clone().view(torch.int64)[0])
            failures.append(Failure(rank, bytes(gathered[i, 8:].tolist()).rstrip(b"\0").decode("utf-8", "replace")))
    return sorted(failures, key=lambda f: f.rank)
