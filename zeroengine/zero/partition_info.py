"""What ZeRO tells a matrix-wise optimizer (Adafactor, SM3, Muon: zeroengine/optim/partitioned.py) about its
pieces: where each lies in its parameter, which parameters each bucket holds (and which of them Muon steps, with
per_head_muon's head counts), and how to reduce over the ranks that partition them."""
from __future__ import annotations

import torch

from zeroengine import comm
from zeroengine.optim.partitioned import Partition, PartitionAware, PieceOf

from .param_guard import full_shape


def attach_partition(sharded, params: list[torch.nn.Parameter], group_of_slot: list[int]) -> None:
    """Give ``sharded.optimizer`` (when partition-aware) its pieces' places; ``params`` in slot order, and the
    index of each one's param group."""
    optimizer = sharded.optimizer
    if not isinstance(optimizer, PartitionAware):
        return
    shapes = [tuple(full_shape(p)) for p in params]
    places, bucket_params = {}, []
    for bucket, pieces in zip(sharded.layout.buckets, sharded.pieces):
        bucket_params.append([(slot.index, shapes[slot.index]) for slot in bucket.slots])
        for where, piece in zip(bucket.pieces_in_chunk(sharded.rank), pieces):
            places[id(piece)] = PieceOf(where.slot.index, shapes[where.slot.index], where.param_start,
                                        where.param_end, bucket.index)
    muon = frozenset(slot for slot, g in enumerate(group_of_slot) if optimizer.param_groups[g].get("use_muon"))
    heads = {slot: p.muon_num_heads for slot, p in enumerate(params) if getattr(p, "muon_num_heads", None)}
    optimizer.attach_partition(Partition(places, bucket_params, _reduce_over(sharded.group), muon_keys=muon,
                                         heads=heads))


def _reduce_over(group):
    def reduce(tensor: torch.Tensor, op) -> None:
        if comm.get_world_size(group) <= 1:
            return
        target = comm.device_for_backend()
        moved = tensor if tensor.device == target else tensor.to(target)
        comm.all_reduce(moved, op=op, group=group)
        if moved is not tensor:
            tensor.copy_(moved)
    return reduce
