"""The optimizer step of offloaded ZeRO stages, streamed bucket by bucket through two pinned buffers.

With ``offload_optimizer``, the fp32 masters and the optimizer state live in
CPU memory, the gradients on the accelerator. Copying every gradient down
before stepping would need a host copy of all of them (4 bytes per parameter
on top of the optimizer's 12) and would leave the CPU idle during the copy.
Instead (Note: double-buffered offload step):

* bucket b+1's gradient chunk is copied down (converted to the masters' dtype
  on the device first, so the host does no conversion: fp32, or bf16 with
  ``bf16_master_weights_and_grads``) on a side stream, into one of two pinned
  buffers, while the CPU optimizer steps bucket b from the other;
* the unscale and clip factors are applied on the host buffer, in the same
  order and precision as the in-memory path, so results are bit-identical;
* the CPU Adam writes the 16-bit copy of the updated values in the same pass
  (``step_with_copy``) into one of two pinned staging buffers, ready to go
  back up without a conversion; the caller starts sending it at once
  (``bucket_done``) and the buffer is written again two buckets later, after
  that copy has read it.

Host memory beyond the optimizer's own is therefore two buckets of fp32
gradients and two of 16-bit values, whatever the model size (a 16-bit copy of
every offloaded element would cost 2 bytes per parameter: 17 GB of pinned
memory at 10B parameters). Without an accelerator the same code runs with
synchronous copies.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zeroengine.optim.partitioned import stepping


def unscale_and_clip(grad: torch.Tensor, inv_scale: float, clip_coef: float) -> None:
    """In place, in the in-memory path's order and precision: unscale (fp16's loss scale), then clip."""
    if inv_scale != 1.0:
        grad.mul_(inv_scale)
    if clip_coef != 1.0:
        grad.mul_(clip_coef)


@contextmanager
def pieces_holding(pieces: list[torch.nn.Parameter], wheres, grad: torch.Tensor):
    """For one optimizer step over a bucket: each piece's ``.grad`` is its slice of the bucket's chunk gradient
    ``grad`` (``wheres``: the bucket's pieces in this rank's chunk); cleared after, so no piece steps twice."""
    for where, piece in zip(wheres, pieces):
        piece.grad = grad[where.chunk_start:where.chunk_start + where.numel]
    try:
        yield
    finally:
        for piece in pieces:
            piece.grad = None


class OffloadedStep:
    """Steps the offloaded buckets ``buckets`` (layout indices, ascending) of a rank's chunks.

    ``chunks[b]`` is bucket b's fp32 master chunk in CPU memory, ``pieces[b]`` the optimizer's params
    viewing it. ``copy_dtype`` (16-bit training with an optimizer that has ``step_with_copy``): the
    updated values are also written in that dtype, into the staging buffers (``copy_buffers``).
    """

    def __init__(self, optimizer, layout, rank: int, chunks: list[torch.Tensor],
                 pieces: list[list[torch.nn.Parameter]], copy_dtype: torch.dtype | None, pin_memory: bool,
                 buckets: list[int] | None = None, swapper=None, grad_dtype: torch.dtype = torch.float32):
        self.optimizer = optimizer
        self.layout = layout
        self.rank = rank
        self.chunks = chunks
        self.pieces = pieces
        self.buckets = list(range(len(layout.buckets))) if buckets is None else sorted(buckets)
        largest = max((layout.buckets[b].chunk_numel for b in self.buckets), default=0)
        pin = pin_memory and torch.cuda.is_available()
        count = min(2, len(self.buckets))
        # ``grad_dtype``: the masters' dtype, the gradients the in-memory step gives them: fp32, or bf16 for bf16
        # masters (then unscaled and clipped in bf16 as that step does, and half the bytes to copy down).
        self.host_grads = [torch.empty(largest, dtype=grad_dtype, pin_memory=pin) for _ in range(count)]
        self.copy_buffers: list[torch.Tensor] | None = None
        if copy_dtype is not None:
            self.copy_buffers = [torch.empty(largest, dtype=copy_dtype, pin_memory=pin) for _ in range(count)]
        self._stream = None
        self._pending: list[tuple] = [None, None]
        self._readers: list = [None, None]  # per staging buffer: waits until the last send has read it
        self.swapper = swapper  # device "nvme": brings each bucket's masters and state in, and back out

    @torch.no_grad()
    def run(self, device_grads: list[torch.Tensor | None], inv_scale: float, clip_coef: float,
            bucket_done) -> None:
        """Step the offloaded buckets: ``device_grads[b]`` is bucket b's (loss-scaled) gradient chunk on the
        accelerator. ``bucket_done(b, values)`` starts sending bucket b's updated values (the 16-bit staging
        buffer, or the fp32 chunk) back while the next bucket steps; it returns a callable that waits until
        ``values`` has been read (or None), called before the staging buffer is written again."""
        order = self.buckets
        if self.swapper is not None:
            self.swapper.start(order)
        for i in range(min(2, len(order))):
            self._copy_down(i, order[i], device_grads[order[i]])
        for i, b in enumerate(order):
            grad = self._wait(i, b)
            unscale_and_clip(grad, inv_scale, clip_coef)
            if self.swapper is not None:
                self.swapper.bring_in(i)
            values = self._step_bucket(i, b, self.layout.buckets[b], grad)
            self._readers[i % 2] = bucket_done(b, values)
            if self.swapper is not None:  # fp32 training sends the masters themselves: the slot waits for it
                self.swapper.send_out(i, self._readers[i % 2] if self.copy_buffers is None else None)
            if i + 2 < len(order):  # the buffer this bucket used is free again
                self._copy_down(i + 2, order[i + 2], device_grads[order[i + 2]])
        if self.swapper is not None:
            self.swapper.finish()
        for i in range(len(self._readers)):  # the next step writes the staging buffers again
            self._wait_read(i)

    def _copy_down(self, i: int, b: int, grad: torch.Tensor | None) -> None:
        """Copy bucket b's gradient chunk (the i-th offloaded bucket) into host buffer i % 2."""
        host = self.host_grads[i % 2][:self.layout.buckets[b].chunk_numel]
        if grad is None:  # a bare step() with no backward: zero gradients, as the in-memory path uses
            host.zero_()
            self._pending[i % 2] = (b, None, None)
            return
        if grad.device.type != "cuda":
            host.copy_(grad)
            self._pending[i % 2] = (b, None, None)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=grad.device)
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            widened = grad.to(host.dtype)  # convert where it is cheap; the host reads the masters' dtype
            host.copy_(widened, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending[i % 2] = (b, done, widened)  # keep the device temporary alive until the copy is done

    def _wait(self, i: int, b: int) -> torch.Tensor:
        pending_b, event, _ = self._pending[i % 2]
        assert pending_b == b, "offload pipeline out of order"
        if event is not None:
            event.synchronize()
        self._pending[i % 2] = None
        return self.host_grads[i % 2][:self.layout.buckets[b].chunk_numel]

    def _wait_read(self, i: int) -> None:
        reader, self._readers[i % 2] = self._readers[i % 2], None
        if reader is not None:
            reader()

    def _step_bucket(self, i: int, b: int, bucket, grad: torch.Tensor) -> torch.Tensor:
        """Step bucket b (the i-th offloaded one); returns its updated values to send."""
        wheres = bucket.pieces_in_chunk(self.rank)
        with pieces_holding(self.pieces[b], wheres, grad), stepping(self.optimizer, [b]):
            if self.copy_buffers is None:
                self.optimizer.step()
                return self.chunks[b]
            self._wait_read(i)  # bucket i-2's values, sent from this buffer, must have been read
            staging = self.copy_buffers[i % 2][:bucket.chunk_numel]
            self.optimizer.step_with_copy({
                piece: staging[where.chunk_start:where.chunk_start + where.numel]
                for where, piece in zip(wheres, self.pieces[b])})
            # Pieces are contiguous from the chunk's start; the rest is the bucket's tail padding, zero in
            # the masters: zero here too rather than what an earlier bucket left in the buffer.
            staging[sum(w.numel for w in wheres):].zero_()
            return staging

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.host_grads) + list(self.copy_buffers or [])
