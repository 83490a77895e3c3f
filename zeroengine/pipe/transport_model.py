"""An in-order, unbuffered transport, to replay the point-to-point operations ranks posted and find deadlocks.

gloo buffers sends, so a test on CPU completes in orders that hang on NCCL. This model is the strict case
(see :mod:`.channels`' note): each rank's operations on one process group run in the order they were posted
(one queue per rank and group, whatever the peer: stricter than NCCL's queue per pair of ranks, so an order
accepted here is accepted there); a send completes only together with the matching receive, both at the
head of their queues (no message fits a buffer); a receive blocks its rank's posting until it completed (the
data feeds what comes next). Sends do not block posting. A set of programs that cannot finish under these
rules can deadlock on NCCL once messages outgrow its buffers; :func:`replay` names where it stops.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Posted:
    """One point-to-point operation as a rank posted it."""

    op: str  # "send" or "recv"
    peer: int  # global rank
    group: str  # the process group's name (the same on every rank)
    nbytes: int


class Deadlock(RuntimeError):
    pass


def replay(programs: dict[int, list[Posted]]) -> int:
    """Run every rank's ``programs[rank]`` (operations in posting order) on the model; returns the number of
    messages delivered. Raises :class:`Deadlock` naming what every stuck rank waits for, or ValueError for a
    send matched by a receive of another size."""
    position = {rank: 0 for rank in programs}
    waiting: dict[int, tuple[int, str]] = {}  # rank -> the (op index, group) of the receive it blocks in
    queues: dict[tuple[int, str], deque] = {}  # (rank, group) -> indices of its posted, unfinished operations
    delivered = 0
    while True:
        progressed = False
        for rank, program in programs.items():  # post until a receive blocks
            while rank not in waiting and position[rank] < len(program):
                op = program[position[rank]]
                queues.setdefault((rank, op.group), deque()).append(position[rank])
                if op.op == "recv":
                    waiting[rank] = (position[rank], op.group)
                position[rank] += 1
                progressed = True
        for (rank, group), queue in queues.items():  # deliver every matched pair at the heads of two queues
            if not queue or programs[rank][queue[0]].op != "send":
                continue
            send = programs[rank][queue[0]]
            peer_queue = queues.get((send.peer, group))
            if not peer_queue:
                continue
            recv = programs[send.peer][peer_queue[0]]
            if recv.op != "recv" or recv.peer != rank:
                continue
            if recv.nbytes != send.nbytes:
                raise ValueError(f"rank {rank} sent {send.nbytes} bytes in group {group} to rank {send.peer}, which "
                                 f"received {recv.nbytes}")
            queue.popleft()
            finished = peer_queue.popleft()
            if waiting.get(send.peer, (None,))[0] == finished:
                del waiting[send.peer]
            delivered += 1
            progressed = True
        if not progressed:
            break
    stuck = sorted((rank, queue[0]) for (rank, _), queue in queues.items() if queue)
    unposted = [rank for rank, program in programs.items() if position[rank] < len(program)]
    if stuck or unposted:
        lines = [f"rank {rank}: {programs[rank][i].op} {'to' if programs[rank][i].op == 'send' else 'from'} rank "
                 f"{programs[rank][i].peer} in group {programs[rank][i].group} (operation {i})"
                 for rank, i in stuck]
        raise Deadlock("the posted operations cannot all complete on an in-order, unbuffered transport; stuck at:\n"
                       + "\n".join(lines))
    return delivered
