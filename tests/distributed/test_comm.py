"""The comm module: counted collectives and the collective-sequence checker."""
import torch

from zeroengine import comm
from zeroengine.testing import run_distributed


def _collectives_and_counts(rank, world):
    comm.counters.reset()
    t = torch.full((10,), float(rank + 1))
    comm.all_reduce(t)
    out = torch.empty(10 * world)
    comm.all_gather(out, torch.full((10,), float(rank)))
    shard = torch.empty(10)
    comm.reduce_scatter(shard, torch.ones(10 * world))
    b = torch.full((4,), float(rank))
    comm.broadcast(b, src=0)
    return t.tolist(), out.tolist(), shard.tolist(), b.tolist(), comm.counters.snapshot()


def test_collectives_results_and_byte_counts():
    world = 2
    for rank, (t, out, shard, b, counts) in enumerate(run_distributed(_collectives_and_counts, world)):
        assert t == [3.0] * 10
        assert out == [0.0] * 10 + [1.0] * 10
        assert shard == [2.0] * 10
        assert b == [0.0] * 4
        assert counts["all_reduce"] == {"calls": 1, "payload_bytes": 40, "wire_bytes": 2 * 40 * (world - 1) / world}
        assert counts["all_gather"]["payload_bytes"] == 80 and counts["all_gather"]["wire_bytes"] == 40
        assert counts["reduce_scatter"]["payload_bytes"] == 80 and counts["reduce_scatter"]["wire_bytes"] == 40
        assert counts["broadcast"]["calls"] == 1


def _mismatched_ops(rank, world):
    comm.enable_sequence_check(timeout_s=20)
    t = torch.ones(8)
    try:
        if rank == 0:
            comm.all_reduce(t)
        else:
            comm.broadcast(t, src=0)
    except comm.CollectiveMismatchError as exc:
        return str(exc)
    return None


def test_sequence_check_names_ranks_ops_and_call_sites():
    for msg in run_distributed(_mismatched_ops, 2):
        assert msg is not None
        assert "rank 0: all_reduce(float32[8]) at test_comm.py" in msg
        assert "rank 1: broadcast(float32[8]) at test_comm.py" in msg


def _skipped_collective(rank, world):
    comm.enable_sequence_check(timeout_s=3)
    t = torch.ones(4)
    comm.all_reduce(t)  # both ranks reach this one
    if rank == 1:
        return None  # rank 1 skips the next collective (a rank-dependent code path)
    try:
        comm.all_reduce(t)
    except comm.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_sequence_check_reports_a_rank_that_never_arrives():
    msg = run_distributed(_skipped_collective, 2)[0]
    assert "ranks [1] never issued it" in msg
    assert "rank 1: last collective reached: #0 all_reduce(float32[4])" in msg


def test_ring_wire_bytes_formulas():
    assert comm.ring_wire_bytes("all_reduce", 100, 4) == 150
    assert comm.ring_wire_bytes("all_gather", 100, 4) == 75
    assert comm.ring_wire_bytes("reduce_scatter", 100, 1) == 0


def _repeated_handshakes(rank, world):
    import torch.distributed as dist

    from zeroengine.comm.handshake import _store

    got = [comm.handshakes.exchange("op", f"{rank}:0".encode())]
    dist.barrier()
    keys_after_one = _store().num_keys()
    for i in range(1, 6):
        got.append(comm.handshakes.exchange("op", f"{rank}:{i}".encode()))
    dist.barrier()
    return [[p.decode() for p in round_] for round_ in got], keys_after_one, _store().num_keys()


def test_handshakes_return_every_rank_payload_and_do_not_pile_up_in_the_store():
    for rounds, after_one, after_six in run_distributed(_repeated_handshakes, 2):
        assert rounds == [[f"0:{i}", f"1:{i}"] for i in range(6)]
        assert after_six <= after_one + 1  # one round's keys stay (plus the barrier's); not six rounds' worth


def _gathers_to_rank0(rank, world):
    import torch.distributed as dist

    from zeroengine.comm.handshake import _store

    results = [comm.handshakes.gather("tables", f"table of {rank}:{i}".encode()) for i in range(4)]
    dist.barrier()
    left = [k for k in (f"ze_hs/tables/{i}/{r}" for i in range(4) for r in range(world)) if _store().check([k])]
    return [None if r is None else [p.decode() for p in r] for r in results], left


def test_a_handshake_gather_reaches_rank0_only_and_leaves_nothing_in_the_store():
    # a save's file and parameter tables: every rank downloading every rank's grows with world size squared
    (rank0, keys0), (rank1, keys1) = run_distributed(_gathers_to_rank0, 2)
    assert rank0 == [[f"table of 0:{i}", f"table of 1:{i}"] for i in range(4)] and rank1 == [None] * 4
    assert keys0 == keys1 == []  # rank 0 deleted what it read


def _list_forms(rank, world):
    import pytest
    with pytest.raises(TypeError, match="one flat tensor"):
        comm.all_gather([torch.empty(2) for _ in range(world)], torch.ones(2))
    with pytest.raises(TypeError, match="one flat tensor"):
        comm.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(world)])
    return comm.get_rank(group=None)


def test_list_forms_of_collectives_get_a_type_error_that_says_what_to_pass():
    assert run_distributed(_list_forms, 2) == [0, 1]


def _peer_gone(rank, world):
    if rank == 1:
        return ""  # leaves: its process exits and closes its connections
    import time

    time.sleep(1)
    try:
        with comm.collective_context("gradient bucket 3"):
            comm.all_reduce(torch.ones(4))
    except comm.CollectiveError as exc:
        return str(exc)
    return "no error"


def test_a_failed_collective_is_named_with_what_it_was_for():
    # Before, the survivor got gloo's bare "Connection closed by peer" with no op, size or purpose.
    message = run_distributed(_peer_gone, 2, timeout_s=120)[0]
    assert message.startswith("rank 0: all_reduce of 16 bytes over 2 ranks for gradient bucket 3 failed:"), message
    # the harness made the process group itself, so its timeout is not zeroengine's to name
    assert "Another rank died, is stuck" in message and "a collective waits the process group's timeout" in message


def _local_misuse(rank, world):
    try:
        comm.broadcast(torch.ones(2), src=5)  # no rank 5: the caller's mistake, not a peer's
    except (comm.CollectiveError, ValueError) as exc:
        return str(exc)
    return "no error"


def test_a_local_mistake_is_not_blamed_on_other_ranks():
    for message in run_distributed(_local_misuse, 2):
        assert "Another rank died" not in message, message
