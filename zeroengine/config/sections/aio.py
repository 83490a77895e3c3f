"""``aio``: the asynchronous I/O under NVMe offload (DeepSpeed's keys and meanings).

Read by the swap of ``offload_optimizer`` / ``offload_param`` with ``device: "nvme"``
(:mod:`zeroengine.offload.nvme`), which moves tensors through the ``async_io`` op
(threads in ``pread``/``pwrite``, O_DIRECT where aligned: :mod:`zeroengine.ops.aio`).
Without NVMe offload the section configures nothing.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator, model_validator

from ..base import ConfigModel, PositiveInt


class AioConfig(ConfigModel):
    """Asynchronous I/O settings of NVMe offload."""

    block_size: PositiveInt = Field(1_048_576, description="Bytes per I/O request: a tensor's read or write is cut "
                                                           "into requests of this size, served in parallel.")
    queue_depth: PositiveInt = Field(8, description="Requests in flight per I/O thread.")
    thread_count: PositiveInt = Field(1, description="I/O threads per request queue (DeepSpeed's older name for "
                                                     "intra_op_parallelism); requests in flight: queue_depth x "
                                                     "thread_count (at most 64).")
    intra_op_parallelism: Optional[PositiveInt] = Field(
        None, description="DeepSpeed's current name for thread_count; when both are given they must agree.")
    single_submit: bool = Field(False, description="Accepted, no effect: a libaio submission detail (one request "
                                                   "per io_submit); zeroengine's op submits to a thread pool.")
    overlap_events: bool = Field(True, description="Accepted, no effect: a libaio detail (overlapping submission "
                                                   "with completion); the thread pool always overlaps them.")
    use_gds: bool = Field(False, description="NVIDIA GPUDirect Storage; only false (reads and writes go through "
                                             "pinned host buffers).")

    @field_validator("use_gds", mode="after")
    @classmethod
    def _no_gds(cls, value: bool) -> bool:
        if value:
            raise ValueError("GPUDirect Storage is not implemented by zeroengine: NVMe offload reads and writes "
                             "through pinned host buffers; set use_gds to false or remove it")
        return value

    @model_validator(mode="after")
    def _one_thread_count(self) -> "AioConfig":
        if self.intra_op_parallelism is not None:
            if "thread_count" in self.model_fields_set and self.thread_count != self.intra_op_parallelism:
                raise ValueError(f"thread_count ({self.thread_count}) and intra_op_parallelism "
                                 f"({self.intra_op_parallelism}) are two names for one setting and disagree; "
                                 "give one of them")
            self.thread_count = self.intra_op_parallelism
        return self

    def handle_args(self) -> dict:
        """Keyword arguments of :class:`zeroengine.ops.aio.AsyncIOHandle`."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "single_submit": self.single_submit, "overlap_events": self.overlap_events,
                "intra_op_parallelism": self.thread_count}
