"""Every pipeline schedule's point-to-point messages, as the ranks really post them, replayed on an in-order,
unbuffered transport (zeroengine.pipe.transport_model: NCCL's behaviour once messages outgrow its buffers).

gloo buffers sends, so the parity tests pass with orders that hang on NCCL: each rank records what it posts
(through the comm module, the only caller of torch.distributed) during a train_batch and an eval_batch, and
the replay must deliver every message."""
import pytest
from pipe_models import batches, config, pipe_model

import zeroengine
from zeroengine import comm
from zeroengine.pipe.transport_model import Posted, replay
from zeroengine.testing import run_distributed


def _group_name(group) -> str:
    return "world" if group is None else group.group_name


def record(rank, world, stages, micro_batches, schedule, chunks):
    posted = []
    isend, recv = comm.isend, comm.recv

    def recording_isend(tensor, dst, group=None):
        posted.append(Posted("send", dst, _group_name(group), tensor.numel() * tensor.element_size()))
        return isend(tensor, dst, group=group)

    def recording_recv(tensor, src, group=None):
        posted.append(Posted("recv", src, _group_name(group), tensor.numel() * tensor.element_size()))
        return recv(tensor, src, group=group)

    comm.isend, comm.recv = recording_isend, recording_recv
    try:
        dp = world // stages
        engine, *_ = zeroengine.initialize(model=pipe_model(stages, virtual_stages=chunks),
                                           config=config(dp, micro_batches, schedule=schedule))
        data = batches(2, micro_batches, dp)
        engine.train_batch(iter(data[0][engine.mesh.dp_rank]))
        engine.eval_batch(iter(data[1][engine.mesh.dp_rank]))
    finally:
        comm.isend, comm.recv = isend, recv
    return posted


@pytest.mark.parametrize("world,stages,micro_batches,schedule,chunks", [
    (2, 2, 4, "1f1b", 1), (2, 2, 4, "gpipe", 1), (4, 4, 6, "1f1b", 1), (4, 2, 4, "1f1b", 1),
    (2, 2, 4, "interleaved", 2), (2, 2, 4, "interleaved", 3), (4, 4, 4, "interleaved", 2),
])
def test_posted_messages_complete_on_an_in_order_unbuffered_transport(world, stages, micro_batches, schedule,
                                                                      chunks):
    programs = dict(enumerate(run_distributed(record, world, stages, micro_batches, schedule, chunks)))
    sends = sum(op.op == "send" for ops in programs.values() for op in ops)
    assert sends > 0
    assert replay(programs) == sends
    # one direction per group: between two ranks, a group carries messages one way only
    for ops in programs.values():
        for group, peer in {(op.group, op.peer) for op in ops}:
            assert len({op.op for op in ops if (op.group, op.peer) == (group, peer)}) == 1, (group, peer)
