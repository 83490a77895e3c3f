"""The point-to-point channels between pipeline stages: one process group per kind of message and direction.

Note: why every channel carries one kind of message one way.
NCCL runs the point-to-point operations a rank posts on one communicator in the order they were posted, and a
send larger than NCCL's internal buffer does not complete until the peer has reached the matching receive.
So if one communicator carried activations forward and gradients back, 1F1B at two stages would post, on
stage 0, ``send(activation); recv(gradient)`` and on stage 1 ``send(gradient); recv(activation)``: each send
waits behind the other's receive, for ever, once the messages outgrow the buffer (gloo buffers them, which
hides it). Megatron pairs the operations of one schedule slot in a ``batch_isend_irecv``; zeroengine gives
each (kind, direction) its own group instead, where kind is activation or gradient and direction is up (to
a higher pipeline index) or down. On every communicator a rank then only sends or only receives, in the
order the schedule produces the messages, which is the order the receiver consumes them; posting is never
blocked by a send (sends are asynchronous), so the only waits left are the schedule's own dependencies,
which :func:`zeroengine.pipe.schedule.simulate` shows are free of cycles. Interleaved schedules send both
ways (the last stage's chunk feeds the first stage's next chunk; gradients go back round), so they use all
four groups; the others use two. :mod:`zeroengine.pipe.transport_model` replays what ranks posted on an
in-order, unbuffered transport to check this holds for every schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from zeroengine import comm
from zeroengine.comm.groups import new_group
from zeroengine.parallel.mesh import ProcessMesh

KINDS = ("activation", "gradient")


@dataclass(frozen=True)
class Channel:
    """Where one kind of message goes to (or comes from): the peer's global rank and the group it travels in."""

    peer: int
    group: object  # a process group (None: the world, in a world of one pipeline line and no groups)
    kind: str


def direction(src_stage: int, dst_stage: int) -> str:
    return "up" if dst_stage > src_stage else "down"


class PipeChannels:
    """This rank's groups, one per (kind, direction) its pipeline line uses. Made collectively at construction:
    every rank makes every line's groups, in the same order (torch.distributed's rule)."""

    def __init__(self, mesh: ProcessMesh, ring: bool):
        self.mesh, self.ring = mesh, ring
        self.groups: dict[tuple[str, str], object] = {}
        if mesh.pp == 1:
            return  # one stage: no neighbours
        # Activations go up and gradients down; a ring also sends activations down (the last stage to the
        # first) and gradients up (back round).
        needed = [("activation", "up"), ("gradient", "down")]
        if ring:
            needed += [("activation", "down"), ("gradient", "up")]
        for key in needed:
            for ranks in mesh.axis_members("pipe"):
                group = new_group(ranks, host_twin=False) if comm.get_world_size() > 1 else None
                if mesh.rank in ranks:
                    self.groups[key] = group

    def _stage(self, offset: int) -> int | None:
        stage, stages = self.mesh.pp_rank + offset, self.mesh.pp
        if 0 <= stage < stages:
            return stage
        return stage % stages if self.ring else None

    def _channel(self, kind: str, peer_stage: int | None, outgoing: bool) -> Channel | None:
        if peer_stage is None or self.mesh.pp == 1:
            return None
        here = self.mesh.pp_rank
        way = direction(here, peer_stage) if outgoing else direction(peer_stage, here)
        return Channel(self.mesh.stage_rank(peer_stage), self.groups[(kind, way)], kind)

    # Activations flow to the next stage and gradients to the previous one (round the ring when interleaved).
    @property
    def activations_out(self) -> Channel | None:
        return self._channel("activation", self._stage(+1), outgoing=True)

    @property
    def activations_in(self) -> Channel | None:
        return self._channel("activation", self._stage(-1), outgoing=False)

    @property
    def gradients_out(self) -> Channel | None:
        return self._channel("gradient", self._stage(-1), outgoing=True)

    @property
    def gradients_in(self) -> Channel | None:
        return self._channel("gradient", self._stage(+1), outgoing=False)
