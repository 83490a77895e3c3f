"""NVMe offload (ZeRO-Infinity): model states in swap files on a local drive, streamed through host buffers."""
from __future__ import annotations

from .optimizer_swap import OptimizerSwapper
from .swap_folder import SwapFolder

__all__ = ["OptimizerSwapper", "SwapFolder", "optimizer_swapper"]

OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"


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
