"""NVMe offload (ZeRO-Infinity): model states in swap files on a local drive, streamed through host buffers."""
from __future__ import annotations

from .optimizer_swap import OptimizerSwapper
from .param_swap import InCpuBudget, ParamSwapper
from .swap_folder import SwapFolder

__all__ = ["InCpuBudget", "OptimizerSwapper", "ParamSwapper", "SwapFolder", "optimizer_swapper", "param_swapper"]

OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param"


def optimizer_swapper(offload, optimizer, chunks: list, pieces: list, layout, rank: int,
                      host_buckets: list[int], pin: bool) -> OptimizerSwapper:
    """The swap of ``offload_optimizer`` (device "nvme") for a rank's offloaded buckets ``host_buckets``."""
    folder = SwapFolder(offload.nvme_path, OPTIMIZER_KEY)
    buckets = layout.buckets
    try:
        return OptimizerSwapper(
            optimizer, chunks, pieces,
            wheres={b: buckets[b].pieces_in_chunk(rank) for b in host_buckets},
            numels={b: buckets[b].chunk_numel for b in host_buckets},
            buckets=host_buckets, folder=folder, aio_args=offload.aio.handle_args(),
            buffer_count=int(offload.buffer_count), pipeline_read=bool(offload.pipeline_read),
            pipeline_write=bool(offload.pipeline_write), pin=pin)
    except BaseException:
        folder.remove()
        raise


def param_swapper(offload, numels: list[int], dtype, pin: bool, budget: InCpuBudget | None = None) -> ParamSwapper:
    """The swap of ``offload_param`` (device "nvme") for one partitioned buffer's chunks ``numels``; ``budget``:
    what is left of ``max_in_cpu`` for it (shared by the stage's buffers; all of it by default)."""
    folder = SwapFolder(offload.nvme_path, PARAM_KEY + ".nvme_path")
    budget = budget if budget is not None else InCpuBudget(int(offload.max_in_cpu))
    try:
        return ParamSwapper(numels, dtype, folder, offload.aio.handle_args(), int(offload.buffer_count),
                            int(offload.buffer_size), budget, pin, PARAM_KEY)
    except BaseException:
        folder.remove()
        raise
