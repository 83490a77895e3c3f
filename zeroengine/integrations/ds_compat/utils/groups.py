"""``deepspeed.utils.groups``: the process-group questions DeepSpeed-style sequence-parallel scripts ask
(``_get_sequence_parallel_group/_world_size/_rank`` and the sequence-data-parallel ones), answered from the
sequence-parallel mesh (zeroengine.sequence_parallel.parallel_state). Before sequence parallelism is set up the
answers are DeepSpeed's: size 1, rank 0, and no group (a KeyError)."""
from __future__ import annotations

from zeroengine import comm
from zeroengine.sequence_parallel import parallel_state


def _get_sequence_parallel_world_size() -> int:
    return parallel_state.get_sequence_parallel_world_size() if parallel_state.sequence_parallel_is_initialized() \
        else 1


def _get_sequence_parallel_rank() -> int:
    return parallel_state.get_sequence_parallel_rank() if parallel_state.sequence_parallel_is_initialized() else 0


def _get_sequence_parallel_group():
    if not parallel_state.sequence_parallel_is_initialized():
        raise KeyError("No sequence parallel group found")
    return parallel_state.get_sequence_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return parallel_state.get_sequence_data_parallel_world_size() \
        if parallel_state.sequence_parallel_is_initialized() else comm.get_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return parallel_state.get_sequence_data_parallel_rank() if parallel_state.sequence_parallel_is_initialized() \
        else comm.get_rank()


def _get_sequence_data_parallel_group():
    return parallel_state.get_sequence_data_parallel_group() if parallel_state.sequence_parallel_is_initialized() \
        else None
