"""zeroengine.comm: process groups, counted collectives, and the collective-sequence checker."""
from .backend import (
    default_backend,
    device_for_backend,
    disable_sequence_check,
    enable_sequence_check,
    get_global_rank,
    get_rank,
    get_rank_in,
    get_world_size,
    init_distributed,
    sequence_check_active,
    sequence_check_requested,
    shutdown,
)
from .collectives import (
    CollectiveError,
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    all_reduce_scalar,
    all_reduce_value,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    collective_context,
    control_all_gather,
    irecv,
    isend,
    recv,
    recv_from_any,
    reduce_scatter,
    send,
    wait_all,
)
from .counters import CommCounters, counters, ring_wire_bytes
from .groups import destroy_group, host_group, new_group
from .handshake import HandshakeTimeout, handshakes
from .outcome import Failure, agree_outcome
from .sequence_check import CollectiveMismatchError

__all__ = [
    "agree_outcome", "Failure", "all_gather", "all_gather_object", "all_reduce", "all_reduce_scalar", "all_reduce_value", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
    "collective_context", "CollectiveError", "control_all_gather", "CollectiveMismatchError", "CommCounters", "counters", "default_backend",
    "destroy_group", "device_for_backend", "disable_sequence_check", "enable_sequence_check", "get_global_rank", "get_rank", "get_rank_in",
    "get_world_size", "handshakes", "host_group", "HandshakeTimeout", "init_distributed", "irecv", "isend", "new_group", "recv", "recv_from_any", "reduce_scatter",
    "ReduceOp", "send",
    "ring_wire_bytes", "sequence_check_active", "sequence_check_requested", "shutdown", "wait_all"
]
