"""``deepspeed.comm`` with DeepSpeed 0.19.8's signatures, over zeroengine's comm module (every collective
counted and, under ``comm_debug``, checked).

The list forms DeepSpeed takes from torch.distributed (``all_gather(tensor_list, tensor)``,
``reduce_scatter(output, input_list)``) run as zeroengine's flat collectives: the tensors are packed into one
flat buffer (padded to the largest when their sizes differ) and unpacked after, so they work on every backend,
gloo included (whose own list reduce-scatter some torch versions lack). A tensor where DeepSpeed takes a list is
zeroengine's flat form (``all_gather_into_tensor`` / ``reduce_scatter_tensor``), as before.

Names DeepSpeed's module has and this one lacks are an AttributeError that says so (and what to use).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zeroengine import comm
from zeroengine.comm import ReduceOp, all_reduce, broadcast, get_rank, get_world_size  # noqa: F401

from .entry import init_distributed  # noqa: F401


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The world rank of member ``group_rank`` of ``group``."""
    return comm.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    """The world ranks of ``group``'s members, in group order."""
    return [comm.get_global_rank(group, r) for r in range(comm.get_world_size(group))]


def get_world_group():
    return dist.group.WORLD


def new_group(ranks):
    """A process group over the world ranks ``ranks`` (collective: every rank calls it, members or not)."""
    return comm.new_group(list(ranks))


def destroy_process_group(group=None) -> None:
    """``group``, or with None the whole process group (every rank meets first, so that none tears its
    connections down under a peer still finishing its last collective)."""
    if group is None or group is dist.group.WORLD:
        comm.shutdown()
    else:
        comm.destroy_group(group)


# -- collectives -------------------------------------------------------------------------------------------------

def barrier(group=None, async_op=False, device_ids=None):
    """Every rank of ``group`` waits for the others (``device_ids`` is NCCL's hint, not needed here). With
    ``async_op`` the returned handle is already complete: the wait happened in the call."""
    comm.barrier(group=group)
    return _Unpacked(None, lambda: None) if async_op else None


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False):
    """``output_tensor`` receives every rank's ``tensor``, in rank order."""
    return comm.all_gather(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """``tensor`` holds world-size equal chunks; ``output_tensor`` gets this rank's chunk reduced over ranks."""
    return comm.reduce_scatter(output_tensor, tensor, op=op, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return comm.all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    return comm.reduce_scatter(output_tensor, tensor, op=op, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """DeepSpeed's (torch's) form: ``tensor_list[r]`` receives rank r's ``tensor``. Sizes may differ by rank
    (each rank passes the same list of sizes). A tensor in place of the list: zeroengine's flat form."""
    if isinstance(tensor_list, torch.Tensor):
        return comm.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    outputs = _tensor_list("all_gather", "tensor_list", tensor_list, group, tensor.dtype)
    width = max(t.numel() for t in outputs)
    if tensor.numel() > width:
        raise ValueError(f"deepspeed.comm.all_gather: tensor has {tensor.numel()} elements, more than any entry of "
                         f"tensor_list ({width})")
    padded = tensor.new_zeros(width)
    padded[:tensor.numel()] = tensor.reshape(-1)
    gathered = tensor.new_empty(width * len(outputs))

    def unpack():
        with torch.no_grad():
            for out, row in zip(outputs, gathered.view(len(outputs), width)):
                out.copy_(row[:out.numel()].view_as(out))

    return _then(comm.all_gather(gathered, padded, group=group, async_op=async_op), unpack)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """DeepSpeed's (torch's) form: ``output`` gets ``input_list[rank]`` reduced over ranks (``input_list[r]`` has
    rank r's output size on every rank). A tensor in place of the list: zeroengine's flat form."""
    if isinstance(input_list, torch.Tensor):
        return comm.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
    inputs = _tensor_list("reduce_scatter", "input_list", input_list, group, output.dtype)
    width = max(t.numel() for t in inputs)
    if inputs[comm.get_rank_in(group)].numel() != output.numel():
        raise ValueError(f"deepspeed.comm.reduce_scatter: output has {output.numel()} elements but this rank's "
                         f"entry of input_list {inputs[comm.get_rank_in(group)].numel()}")
    packed = output.new_zeros(width * len(inputs))
    for row, t in zip(packed.view(len(inputs), width), inputs):
        row[:t.numel()] = t.reshape(-1)
    mine = output.new_empty(width)

    def unpack():
        with torch.no_grad():
            output.copy_(mine[:output.numel()].view_as(output))

    return _then(comm.reduce_scatter(mine, packed, op=op, group=group, async_op=async_op), unpack)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    return comm.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None):
    """``object_list`` (one entry per rank) receives every rank's picklable ``obj``, in rank order."""
    gathered = comm.all_gather_object(obj, group=group)
    if len(object_list) != len(gathered):
        raise ValueError(f"deepspeed.comm.all_gather_object: object_list has {len(object_list)} entries; it needs "
                         f"one per rank ({len(gathered)})")
    object_list[:] = gathered


def broadcast_object_list(object_list, src, group=None, device=None):
    """``object_list``'s entries on every rank become those of world rank ``src``."""
    comm.broadcast_object_list(object_list, src, group=group, device=device)


# -- point to point (world ranks) --------------------------------------------------------------------------------

def send(tensor, dst, group=None, tag=0):
    comm.send(tensor, dst, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0):
    return comm.isend(tensor, dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0) -> int:
    """Receive into ``tensor`` from ``src`` (any rank when None); returns the sender's world rank."""
    if src is None:
        return comm.recv_from_any(tensor, group=group, tag=tag)
    comm.recv(tensor, src, group=group, tag=tag)
    return src


def irecv(tensor, src=None, group=None, tag=0):
    if src is None:
        raise ValueError("deepspeed.comm.irecv(src=None): receiving from any rank is only blocking here; pass the "
                         "sender's rank, or call recv(tensor) (which returns it)")
    return comm.irecv(tensor, src, group=group, tag=tag)


# -- helpers -----------------------------------------------------------------------------------------------------

def _tensor_list(name: str, arg: str, tensors, group, dtype) -> list[torch.Tensor]:
    tensors = list(tensors)
    world = comm.get_world_size(group)
    if len(tensors) != world or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"deepspeed.comm.{name}: {arg} must hold one tensor per rank of the group ({world}), got "
                         f"{len(tensors)} item(s)")
    if any(t.dtype != dtype for t in tensors):
        raise TypeError(f"deepspeed.comm.{name}: every tensor of {arg} must have dtype {dtype}")
    return tensors


class _Unpacked:
    """The handle of an asynchronous list collective: ``wait`` also copies the result out of the flat buffer."""

    def __init__(self, handle, unpack):
        self._handle, self._unpack, self._done = handle, unpack, False

    def wait(self, timeout=None):
        if not self._done:
            if self._handle is not None:
                self._handle.wait()
            self._unpack()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _then(handle, unpack):
    if handle is None:  # synchronous: done
        unpack()
        return None
    return _Unpacked(handle, unpack)


# DeepSpeed's names this module does not provide, and what to use instead.
_MISSING = {
    "all_to_all": "all_to_all_single on one flat tensor",
    "reduce": "all_reduce (every rank gets the result)",
    "gather": "all_gather (every rank gets the result)",
    "scatter": "broadcast, or torch.distributed.scatter",
    "batch_isend_irecv": "isend / irecv",
    "P2POp": "isend / irecv",
    "monitored_barrier": "barrier (a rank that does not arrive is named after ZEROENGINE_COMM_TIMEOUT)",
    "inference_all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce on one flat tensor",
    "all_gather_coalesced": "all_gather_into_tensor on one flat tensor",
    "log_summary": "zeroengine.comm.counters (every collective's calls and bytes) or the monitor's comm/* metrics",
    "configure": "the config's comm_debug key (comms_logger is not supported)",
    "initialize_mesh_device": "the config's tensor_parallel / sequence_parallel_size keys",
}


def __getattr__(name: str):
    if name in _MISSING:
        raise AttributeError(f"deepspeed.comm.{name} is not provided by zeroengine's DeepSpeed alias; use "
                             f"{_MISSING[name]}")
    raise AttributeError(f"module 'deepspeed.comm' (zeroengine's) has no attribute {name!r}")
