"""``deepspeed.comm`` under the ``ZEROENGINE_AS_DEEPSPEED`` alias on a 2-rank gloo world, every function of
issue 34 in one run (DeepSpeed 0.19.8's signatures): groups and ranks, the flat and the list forms of all-gather and
reduce-scatter (gloo's list reduce-scatter is built from the flat one), point to point, object collectives, the
counters they go through, and destroying groups; and ``deepspeed.zero.Init(module=..., mpu=...)`` partitioning over
the mpu's data-parallel group."""
from __future__ import annotations

import sys

import torch

from zeroengine.testing import run_distributed


def _surface(rank, world):
    from zeroengine.integrations import as_deepspeed

    sys.meta_path.insert(0, as_deepspeed.DeepSpeedAliasFinder())  # (this worker process only)
    import deepspeed
    import deepspeed.comm as dist

    from zeroengine import comm
    from zeroengine.zero import GatheredParameters

    out = {"world": (dist.get_rank(), dist.get_world_size(), dist.is_initialized())}
    comm.counters.reset()

    # flat forms
    gathered = torch.empty(4)
    dist.all_gather_into_tensor(gathered, torch.full((2,), rank + 1.0))
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(4.0) * (rank + 1))
    out["flat"] = (gathered.tolist(), scattered.tolist())

    # list forms: equal sizes, sizes differing by rank, asynchronous, and another reduction
    parts = [torch.empty(2), torch.empty(2)]
    dist.all_gather(parts, torch.tensor([rank, 10.0 + rank]))
    uneven = [torch.empty(1), torch.empty(3)]
    handle = dist.all_gather(uneven, torch.arange(rank * 2 + 1.0) + 100 * rank, async_op=True)
    handle.wait()
    mine = torch.empty(2 if rank == 0 else 3)
    dist.reduce_scatter(mine, [torch.full((2,), rank + 1.0), torch.arange(3.0) + rank])
    largest = torch.empty(2)
    h = dist.reduce_scatter(largest, [torch.tensor([rank, -rank]) * 1.0, torch.tensor([5.0 * rank, 1.0])],
                            op=dist.ReduceOp.MAX, async_op=True)
    h.wait()
    out["lists"] = ([p.tolist() for p in parts], [u.tolist() for u in uneven], mine.tolist(), largest.tolist())

    # groups and ranks
    pair = dist.new_group([0, 1])
    alone = dist.new_group([1])
    out["ranks"] = (dist.get_global_rank(pair, 1), dist.get_global_rank(alone, 0) if rank == 1 else None,
                    dist.get_all_ranks_from_group(pair), dist.get_global_rank(None, 1))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=pair)
    out["group_sum"] = total.item()

    # point to point, world ranks
    if rank == 0:
        dist.send(torch.tensor([3.0, 4.0]), dst=1)
        got = torch.empty(2)
        dist.irecv(got, src=1, tag=7).wait()
        any_from = dist.recv(torch.empty(1))  # from whichever rank sends
        out["p2p"] = (got.tolist(), any_from)
    else:
        got = torch.empty(2)
        sender = dist.recv(got, src=0)
        dist.isend(torch.tensor([5.0, 6.0]), dst=0, tag=7).wait()
        dist.send(torch.tensor([1.0]), dst=0)
        out["p2p"] = (got.tolist(), sender)

    # objects
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    announced = [{"from": rank}, rank * 10]
    dist.broadcast_object_list(announced, src=1)
    out["objects"] = (objects, announced)

    # every collective went through zeroengine's comm module (counted)
    counted = comm.counters.snapshot()
    out["counted"] = {op: counted.get(op, {}).get("calls", 0)
                      for op in ("all_gather", "reduce_scatter", "send", "recv", "control")}

    # zero.Init(module=..., mpu=...): the mpu's data group (here each rank alone: a tensor-parallel pair) is the
    # one partitioned over, so each rank keeps its own slice's values
    class Mpu:
        def __init__(self):
            self.groups = [comm.new_group([0]), comm.new_group([1])]

        def get_data_parallel_group(self):
            return self.groups[rank]

    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.fill_(rank + 1.0)
    deepspeed.zero.Init(module=layer, mpu=Mpu(), dtype=torch.float64)
    with GatheredParameters([layer.weight]):
        out["init"] = (layer.weight.dtype == torch.float64, layer.weight.unique().tolist())

    dist.destroy_process_group(pair)
    if rank == 1:
        dist.destroy_process_group(alone)
    dist.barrier()
    dist.destroy_process_group()
    out["destroyed"] = not dist.is_initialized()
    return out


def test_deepspeed_comm_functions_on_two_ranks():
    zero, one = run_distributed(_surface, 2)
    assert zero["world"] == (0, 2, True) and one["world"] == (1, 2, True)
    for rank, out in enumerate((zero, one)):
        assert out["flat"] == ([1.0, 1.0, 2.0, 2.0], [[0.0, 3.0], [6.0, 9.0]][rank])
        parts, uneven, mine, largest = out["lists"]
        assert parts == [[0.0, 10.0], [1.0, 11.0]]
        assert uneven == [[0.0], [100.0, 101.0, 102.0]]
        assert mine == [[3.0, 3.0], [1.0, 3.0, 5.0]][rank]
        assert largest == [[1.0, 0.0], [5.0, 1.0]][rank]
        assert out["ranks"][0] == 1 and out["ranks"][2] == [0, 1] and out["ranks"][3] == 1
        assert out["group_sum"] == 3.0
        assert out["objects"] == ([{"rank": 0}, {"rank": 1}], [{"from": 1}, 10])
        assert out["init"] == (True, [rank + 1.0])  # its own values, in float64
        assert out["destroyed"]
        assert out["counted"]["all_gather"] == 3 and out["counted"]["reduce_scatter"] == 3
        assert out["counted"]["send"] == [1, 2][rank] and out["counted"]["recv"] == [2, 1][rank]
        assert out["counted"]["control"] == 2  # all_gather_object, broadcast_object_list
    assert one["ranks"][1] == 1
    assert zero["p2p"] == ([5.0, 6.0], 1) and one["p2p"] == ([3.0, 4.0], 0)
