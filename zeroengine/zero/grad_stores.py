"""Where gradients live between backward and step: the difference between stages 1 and 2.

Both stores end a boundary with the same thing, this rank's *averaged
gradient chunk* of every bucket (``chunk_grads``); they differ in what a rank
holds on the way:

* :class:`FullGradStore` (stage 1): full gradients, as views into one flat
  buffer that autograd accumulates into; one reduce-scatter per bucket at the
  accumulation boundary.
* :class:`PartitionedGradStore` (stage 2): only this rank's gradient chunks.
  As soon as all gradients of a bucket are ready in backward, the bucket is
  reduce-scattered (asynchronously with ``overlap_comm``) and the full
  gradients are freed; chunks accumulate across micro-steps.

Note: bucket launch order. Collectives must be issued in the same order on
every rank, but autograd's ready order can differ between ranks (a parameter
unused on one rank only). Buckets are therefore launched strictly in layout
order: a ready bucket waits for every earlier bucket, and the end of backward
flushes the rest (missing gradients count as zeros).
"""
from __future__ import annotations

import torch

from zeroengine import comm

from .flat_params import FlatParamBuffer
from .layout import Bucket, FlatLayout


class _BucketReducer:
    """Reduce-scatter of one bucket buffer into this rank's (averaged) chunk, optionally async."""

    def __init__(self, rank: int, world: int, group, comm_dtype: torch.dtype | None, overlap: bool):
        self.rank, self.world, self.group = rank, world, group
        self.comm_dtype = comm_dtype
        self.overlap = overlap
        self._in_flight: list[tuple[object, torch.Tensor, Bucket, torch.Tensor]] = []

    def launch(self, bucket: Bucket, buffer: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Reduce-scatter ``buffer`` (the bucket) into ``out`` (default: a new chunk-sized tensor)."""
        if self.comm_dtype is not None and buffer.dtype != self.comm_dtype:
            buffer = buffer.to(self.comm_dtype)
            out = None
        if out is None:
            out = torch.empty(bucket.chunk_numel, dtype=buffer.dtype, device=buffer.device)
        work = comm.reduce_scatter(out, buffer, group=self.group, async_op=self.overlap)
        self._in_flight.append((work, out, bucket, buffer))

    def drain(self):
        """Wait for every launched bucket; yield (bucket, averaged chunk, the buffer it was reduced from)."""
        in_flight, self._in_flight = self._in_flight, []
        for work, out, bucket, buffer in in_flight:
            if work is not None:
                work.wait()
            yield bucket, out.div_(self.world), buffer


class FullGradStore:
    """Stage 1 (see module doc)."""

    def __init__(self, flat_params: FlatParamBuffer, reducer: _BucketReducer):
        self.flat_params = flat_params
        self.layout: FlatLayout = flat_params.layout
        self.reducer = reducer
        self.flat_grads = torch.zeros_like(flat_params.flat)
        self.chunk_grads: list[torch.Tensor | None] = [None] * len(self.layout.buckets)
        self._attach_grad_views()

    def _grad_view(self, slot) -> torch.Tensor:
        p = self.flat_params.params[slot.index]
        return self.flat_grads[slot.flat_start:slot.flat_end].view(p.shape)

    def _attach_grad_views(self) -> None:
        """Point every .grad into flat_grads, keeping what autograd put elsewhere (e.g. after zero_grad(set_to_none))."""
        for bucket in self.layout.buckets:
            for slot in bucket.slots:
                p = self.flat_params.params[slot.index]
                view = self._grad_view(slot)
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    def finish_backward(self, is_boundary: bool) -> None:
        if not is_boundary:
            return
        self._attach_grad_views()
        rank = self.reducer.rank
        for bucket in self.layout.buckets:
            lo, hi = bucket.chunk_range(rank)
            # Reduced in place into this rank's own chunk of the flat gradients: no extra memory.
            self.reducer.launch(bucket, self.flat_grads[bucket.flat_start:bucket.flat_start + bucket.padded_numel],
                                out=self.flat_grads[lo:hi])
        for bucket, chunk, _ in self.reducer.drain():
            self.chunk_grads[bucket.index] = chunk.to(self.flat_grads.dtype)

    def zero(self) -> None:
        self.flat_grads.zero_()
        self.chunk_grads = [None] * len(self.layout.buckets)
        self._attach_grad_views()

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.flat_grads] + [c for c in self.chunk_grads if c is not None]

    def comm_buffers(self) -> list[torch.Tensor]:
        return []


class PartitionedGradStore:
    """Stage 2 (see module doc)."""

    def __init__(self, flat_params, reducer: _BucketReducer, contiguous_gradients: bool, on_bucket_ready=None):
        self.params = flat_params.params
        self.layout: FlatLayout = flat_params.layout
        self.reducer = reducer
        dtype = flat_params.dtype
        device = flat_params.device
        self.chunk_grads = [torch.zeros(b.chunk_numel, dtype=dtype, device=device) for b in self.layout.buckets]
        self._bucket_of = self.layout.bucket_of_param()
        self._ready = [0] * len(self.layout.buckets)
        self._next = 0
        # contiguous_gradients: reuse one preallocated buffer per bucket size instead of allocating per bucket.
        self._pool: dict[int, list[torch.Tensor]] | None = {} if contiguous_gradients else None
        # Stage 3 frees a bucket's gathered parameters once all its gradients exist.
        self._on_bucket_ready = on_bucket_ready
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    def _make_hook(self, index: int):
        def hook(_param):
            bucket = self._bucket_of[index]
            self._ready[bucket] += 1
            if self._on_bucket_ready is not None and self._ready[bucket] == len(self.layout.buckets[bucket].slots):
                self._on_bucket_ready(self.layout.buckets[bucket])
            self._launch_ready(force=False)

        return hook

    def _launch_ready(self, force: bool) -> None:
        buckets = self.layout.buckets
        while self._next < len(buckets) and (force or self._ready[self._next] >= len(buckets[self._next].slots)):
            self._launch(buckets[self._next])
            self._next += 1

    def _take_buffer(self, bucket: Bucket) -> torch.Tensor:
        free = self._pool.get(bucket.padded_numel) if self._pool is not None else None
        if free:
            buf = free.pop()
            buf.zero_()
            return buf
        p0 = self.params[bucket.slots[0].index]
        return torch.zeros(bucket.padded_numel, dtype=p0.dtype, device=p0.device)

    def _launch(self, bucket: Bucket) -> None:
        buffer = self._take_buffer(bucket)
        for slot in bucket.slots:
            p = self.params[slot.index]
            if p.grad is not None:
                start = slot.flat_start - bucket.flat_start
                buffer[start:start + slot.numel].copy_(p.grad.reshape(-1))
                p.grad = None  # the full gradient is dropped as soon as it is in the bucket
        self.reducer.launch(bucket, buffer)

    def finish_backward(self, is_boundary: bool) -> None:
        # Stage 2 reduces every micro-step: keeping full gradients until the
        # boundary would defeat its memory saving.
        self._launch_ready(force=True)
        for bucket, chunk, buffer in self.reducer.drain():
            self.chunk_grads[bucket.index].add_(chunk)
            if self._pool is not None and buffer.dtype == chunk.dtype:
                self._pool.setdefault(bucket.padded_numel, []).append(buffer)
        self._ready = [0] * len(self.layout.buckets)
        self._next = 0

    def zero(self) -> None:
        for c in self.chunk_grads:
            c.zero_()
        for p in self.params:
            p.grad = None

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.chunk_grads)

    def comm_buffers(self) -> list[torch.Tensor]:
        return [b for bufs in (self._pool or {}).values() for b in bufs]
