"""Stage 3's parameters: each rank stores only its chunks; full tensors exist while a module needs them.

Every trainable parameter's ``.data`` is an empty tensor while its bucket is
*sharded*; ``gather(bucket)`` all-gathers the bucket into a full buffer and
points the parameters at views of it; ``release(bucket)`` frees the buffer.
Autograd keeps working across release/gather because a saved leaf parameter is
read through the Parameter object, whose ``.data`` is gathered again before
the module's backward runs (see :mod:`zeroengine.zero.stage3_hooks`).
"""
from __future__ import annotations

import torch

from zeroengine import comm

from .flat_params import ParamBuffer, gather_chunk
from .layout import Bucket, FlatLayout


class PartitionedParamBuffer(ParamBuffer):
    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, dtype: torch.dtype, rank: int,
                 group=None):
        super().__init__(params, layout, dtype, rank, group)
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=self.device)
        self._chunk_start = []
        offset = 0
        for bucket in layout.buckets:
            self._chunk_start.append(offset)
            offset += bucket.chunk_numel
        with torch.no_grad():
            for bucket in layout.buckets:
                self.chunk_view(bucket, rank).copy_(gather_chunk(params, bucket, rank, dtype))
        self.full: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self._empty = torch.empty(0, dtype=dtype, device=self.device)
        for bucket in layout.buckets:
            self._point_at_nothing(bucket)

    def chunk_view(self, bucket: Bucket, rank: int) -> torch.Tensor:
        if rank != self.rank:
            raise ValueError(f"rank {self.rank} holds only its own chunks, not rank {rank}'s")
        start = self._chunk_start[bucket.index]
        return self.shard[start:start + bucket.chunk_numel]

    def is_gathered(self, bucket: Bucket) -> bool:
        return self.full[bucket.index] is not None

    def gather(self, bucket: Bucket) -> None:
        if self.full[bucket.index] is not None:
            return
        full = torch.empty(bucket.padded_numel, dtype=self.dtype, device=self.shard.device)
        comm.all_gather(full, self.chunk_view(bucket, self.rank), group=self.group)
        self.full[bucket.index] = full
        for slot in bucket.slots:
            start = slot.flat_start - bucket.flat_start
            p = self.params[slot.index]
            p.data = full[start:start + slot.numel].view(self.shapes[slot.index])

    def release(self, bucket: Bucket) -> None:
        if self.full[bucket.index] is None:
            return
        self.full[bucket.index] = None
        self._point_at_nothing(bucket)

    def _point_at_nothing(self, bucket: Bucket) -> None:
        for slot in bucket.slots:
            self.params[slot.index].data = self._empty

    def after_step(self, chunks: list[torch.Tensor]) -> None:
        """Take the optimizer's updated chunks; re-gather any bucket that is gathered right now."""
        with torch.no_grad():
            for bucket, chunk in zip(self.layout.buckets, chunks):
                view = self.chunk_view(bucket, self.rank)
                if chunk.data_ptr() != view.data_ptr():
                    view.copy_(chunk)
                if self.is_gathered(bucket):
                    self.full[bucket.index] = None
                    self.gather(bucket)

    def set_param_value(self, slot, bucket: Bucket, flat_value: torch.Tensor) -> None:
        """Keep this rank's slice of a new full value (and the gathered copy, if any)."""
        own = bucket.piece(slot, self.rank)
        if own is not None:
            self.chunk_view(bucket, self.rank)[own.chunk_start:own.chunk_start + own.numel].copy_(
                flat_value[own.param_start:own.param_end])
        full = self.full[bucket.index]
        if full is not None:
            start = slot.flat_start - bucket.flat_start
            full[start:start + slot.numel].copy_(flat_value)

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.shard] + [f for f in self.full if f is not None]
