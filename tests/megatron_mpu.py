"""Megatron-style model-parallel units (the ``mpu`` DeepSpeed's and zeroengine's initialize take) over a world of
4: tensor pairs (0, 1) and (2, 3), data pairs (0, 2) and (1, 3), made by the user, not by zeroengine."""
from __future__ import annotations

from zeroengine import comm
from zeroengine.comm.groups import new_group


class TensorMpu:
    """Megatron-core's names (``get_tensor_model_parallel_*``, ``get_data_parallel_*``); no model group."""

    def __init__(self):
        rank = comm.get_rank()
        self.tp = {r: g for ranks in ([0, 1], [2, 3]) for g in [new_group(ranks)] for r in ranks}[rank]
        self.dp = {r: g for ranks in ([0, 2], [1, 3]) for g in [new_group(ranks)] for r in ranks}[rank]
        self.rank = rank

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_world_size(self):
        return 2

    def get_data_parallel_rank(self):
        return self.rank // 2

    def get_tensor_model_parallel_group(self):
        return self.tp

    def get_tensor_model_parallel_world_size(self):
        return 2

    def get_tensor_model_parallel_rank(self):
        return self.rank % 2


class TensorMpuWithModelGroup(TensorMpu):
    """And the older names, whose model group (tensor parallelism alone) is the tensor group."""

    def get_model_parallel_group(self):
        return self.tp

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return self.rank % 2
