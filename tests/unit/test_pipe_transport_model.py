"""The in-order, unbuffered transport model (zeroengine.pipe.transport_model) the pipeline's channel test
replays recorded operations on: it must find the deadlocks NCCL would hit, and accept what cannot hang."""
import pytest

from zeroengine.pipe.schedule import one_f_one_b
from zeroengine.pipe.transport_model import Deadlock, Posted, replay


def one_f_one_b_programs(groups: dict[str, str], stages: int = 2, micro_batches: int = 4):
    """What each stage of 1F1B posts (one message per pass), activations in ``groups["activation"]`` and
    gradients in ``groups["gradient"]``."""
    programs = {}
    for s in range(stages):
        ops = []
        for op, _, _ in one_f_one_b(s, stages, micro_batches):
            if op == "F":
                if s > 0:
                    ops.append(Posted("recv", s - 1, groups["activation"], 64))
                if s < stages - 1:
                    ops.append(Posted("send", s + 1, groups["activation"], 64))
            else:
                if s < stages - 1:
                    ops.append(Posted("recv", s + 1, groups["gradient"], 32))
                if s > 0:
                    ops.append(Posted("send", s - 1, groups["gradient"], 32))
        programs[s] = ops
    return programs


def test_both_directions_in_one_group_deadlock():
    """Review finding: 1F1B at two stages, activations and gradients sharing one communicator: stage 0 posts
    send(activation) before recv(gradient), stage 1 send(gradient) before recv(activation)."""
    with pytest.raises(Deadlock, match="rank 0: send to rank 1 in group g .*\n.*rank 1: send to rank 0 in group g"):
        replay(one_f_one_b_programs({"activation": "g", "gradient": "g"}))


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_a_group_per_kind_and_direction_completes(stages):
    programs = one_f_one_b_programs({"activation": "act-up", "gradient": "grad-down"}, stages=stages, micro_batches=6)
    sends = sum(op.op == "send" for ops in programs.values() for op in ops)
    assert replay(programs) == sends


def test_a_receive_blocks_what_its_rank_posts_after_it():
    """Two ranks each receiving first: nothing can be posted behind the receives (a wait cycle)."""
    programs = {0: [Posted("recv", 1, "a", 8), Posted("send", 1, "b", 8)],
                1: [Posted("recv", 0, "b", 8), Posted("send", 0, "a", 8)]}
    with pytest.raises(Deadlock):
        replay(programs)


def test_one_queue_per_rank_and_group_whatever_the_peer():
    """Rank 1's send to rank 2 waits behind its send to rank 0 in the same group (stricter than one queue per
    pair of ranks): rank 0 reads that only after hearing from rank 2, which waits for rank 1's second send."""
    programs = {0: [Posted("recv", 2, "b", 8), Posted("recv", 1, "a", 8)],
                1: [Posted("send", 0, "a", 8), Posted("send", 2, "a", 8)],
                2: [Posted("recv", 1, "a", 8), Posted("send", 0, "b", 8)]}
    with pytest.raises(Deadlock, match="rank 1: send to rank 0 in group a"):
        replay(programs)
    programs[1] = [Posted("send", 2, "a", 8), Posted("send", 0, "a", 8)]  # the other order completes
    assert replay(programs) == 3


def test_a_size_mismatch_is_named():
    with pytest.raises(ValueError, match="rank 0 sent 8 bytes in group a to rank 1, which received 4"):
        replay({0: [Posted("send", 1, "a", 8)], 1: [Posted("recv", 0, "a", 4)]})
