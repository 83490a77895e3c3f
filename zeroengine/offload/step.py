"""The optimizer step of offloaded ZeRO stages, streamed bucket by bucket through two pinned buffers.

With ``offload_optimizer``, the fp32 masters and the optimizer state live in
CPU memory, the gradients on the accelerator. Copying every gradient down
before stepping would need a host copy of all of them (4 bytes per parameter
on top of the optimizer's 12) and would leave the CPU idle during the copy.
Instead (Note: double-buffered offload step):

* bucket b+1's gradient chunk is copied down (converted to fp32 on the device
  first, so the host does no conversion) on a side stream, into one of two
  pinned buffers, while the CPU optimizer steps bucket b from the other;
* the unscale and clip factors are applied on the host buffer, in the same
  order and precision as the in-memory path, so results are bit-identical;
* the CPU Adam writes the 16-bit copy of the updated values in the same pass
  (``step_with_copy``), ready to go back up without a conversion.

Host memory beyond the optimizer's own is therefore two buckets of fp32
gradients, whatever the model size. Without an accelerator the same code runs
with synchronous copies.
"""
from __future__ import annotations

import torch


class OffloadedStep:
    """Steps the offloaded buckets ``buckets`` (layout indices, ascending) of a rank's chunks."""

    def __init__(self, optimizer, layout, rank: int, pieces: list[list[torch.nn.Parameter]],
                 copy_out: list[torch.Tensor | None] | None, pin_memory: bool, buckets: list[int] | None = None):
        self.optimizer = optimizer
        self.layout = layout
        self.rank = rank
        self.pieces = pieces
        self.copy_out = copy_out
        self.buckets = list(range(len(layout.buckets))) if buckets is None else sorted(buckets)
        largest = max((layout.buckets[b].chunk_numel for b in self.buckets), default=0)
        pin = pin_memory and torch.cuda.is_available()
        self.host_grads = [torch.empty(largest, dtype=torch.float32, pin_memory=pin)
                           for _ in range(min(2, len(self.buckets)))]
        self._stream = None
        self._pending: list[tuple] = [None, None]

    @torch.no_grad()
    def run(self, device_grads: list[torch.Tensor | None], inv_scale: float, clip_coef: float,
            bucket_done=None) -> None:
        """Step the offloaded buckets: ``device_grads[b]`` is bucket b's (loss-scaled) gradient chunk on the
        accelerator; ``bucket_done(b)`` (optional) starts sending bucket b's updated values back while the
        next bucket steps."""
        order = self.buckets
        for i in range(min(2, len(order))):
            self._copy_down(i, order[i], device_grads[order[i]])
        for i, b in enumerate(order):
            grad = self._wait(i, b)
            if inv_scale != 1.0:
                grad.mul_(inv_scale)
            if clip_coef != 1.0:
                grad.mul_(clip_coef)
            self._step_bucket(b, self.layout.buckets[b], grad)
            if bucket_done is not None:
                bucket_done(b)
            if i + 2 < len(order):  # the buffer this bucket used is free again
                self._copy_down(i + 2, order[i + 2], device_grads[order[i + 2]])

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
            widened = grad.float()  # convert where it is cheap; the host only reads fp32
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

    def _step_bucket(self, b: int, bucket, grad: torch.Tensor) -> None:
        wheres = bucket.pieces_in_chunk(self.rank)
        for where, piece in zip(wheres, self.pieces[b]):
            piece.grad = grad[where.chunk_start:where.chunk_start + where.numel]
        try:
            if self.copy_out is None:
                self.optimizer.step()
            else:
                self.optimizer.step_with_copy({
                    piece: self.copy_out[b][where.chunk_start:where.chunk_start + where.numel]
                    for where, piece in zip(wheres, self.pieces[b])})
        finally:
            for piece in self.pieces[b]:
                piece.grad = None

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.host_grads)
