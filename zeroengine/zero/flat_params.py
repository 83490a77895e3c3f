"""Trainable parameters re-homed into one flat buffer, in the bucket-major layout.

After construction every parameter's ``.data`` is a view into ``flat``: an
all-gather into a bucket's range refreshes those parameters in place, with no
unflatten copies, and a rank's chunk of a bucket is one contiguous slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroengine import comm

from .layout import Bucket, FlatLayout


class ParamBuffer:
    """What stages 1-3 share about the storage of trainable parameters in a layout.

    Two kinds: :class:`FlatParamBuffer` (stages 1-2, every rank holds every
    parameter) and ``PartitionedParamBuffer`` (stage 3, a rank holds its chunks).
    """

    partitioned = False  # True where a rank holds only its chunks (stage 3)

    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, dtype: torch.dtype, rank: int,
                 group=None):
        self.params = params
        self.layout = layout
        self.rank = rank
        self.group = group
        self.dtype = dtype
        self.shapes = [p.shape for p in params]
        self._device = params[0].device if params else torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    def full_shape(self, index: int) -> torch.Size:
        return self.shapes[index]

    def on_drive(self, bucket: Bucket) -> bool:
        """Whether the bucket's chunk is on NVMe (only stage 3's parameter offload puts it there)."""
        return False

    def read_chunk(self, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk of ``bucket``: a view where the buffer holds it (stage 3 with parameters on NVMe: a
        new tensor read from the drive)."""
        return self.chunk_view(bucket, self.rank)

    def check_attached(self) -> None:
        """Raise if the model's parameters no longer live in this buffer. Nothing to check here: stage 3's
        parameters refuse a cast or move themselves (their class guards them); stages 1-2 override it."""


class FlatParamBuffer(ParamBuffer):
    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, dtype: torch.dtype, rank: int,
                 group=None):
        super().__init__(params, layout, dtype, rank, group)
        self.flat = torch.zeros(layout.total_numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            for bucket in layout.buckets:
                for slot in bucket.slots:
                    p = params[slot.index]
                    self.flat[slot.flat_start:slot.flat_end].copy_(p.detach().reshape(-1))
                    p.data = self.flat[slot.flat_start:slot.flat_end].view(p.shape)

    def check_attached(self) -> None:
        """Raise if a parameter's storage is no longer its place in ``flat`` (the model was cast or moved
        after initialize: the engine would go on stepping ``flat`` while the model used other tensors)."""
        lo = self.flat.data_ptr()
        hi = lo + self.flat.numel() * self.flat.element_size()
        for index, p in enumerate(self.params):
            placed = p.numel() == 0 or lo <= p.data_ptr() < hi  # (an empty tensor's data_ptr is 0)
            if p.dtype != self.flat.dtype or p.device != self.flat.device or not placed:
                raise RuntimeError(
                    f"parameter {index} of this optimizer ({tuple(p.shape)}) is now a {p.dtype} tensor on "
                    f"{p.device}, no longer the engine's {self.flat.dtype} buffer on {self.flat.device}: the model "
                    "was cast or moved after initialize (engine.module.half() / .double() / .to(...)), and its "
                    "updates would not reach it. Set the training dtype in the config (fp16 / bf16) and move the "
                    "model before initialize")

    def bucket_view(self, bucket: Bucket) -> torch.Tensor:
        return self.flat[bucket.flat_start:bucket.flat_start + bucket.padded_numel]

    def chunk_view(self, bucket: Bucket, rank: int) -> torch.Tensor:
        lo, hi = bucket.chunk_range(rank)
        return self.flat[lo:hi]

    def after_step(self, chunks: list[torch.Tensor | None]) -> None:
        """All-gather every bucket's updated chunks into every rank's parameters (None: not this time)."""
        self.finish_refresh([self.start_refresh(bucket, chunk) for bucket, chunk in zip(self.layout.buckets, chunks)
                             if chunk is not None])

    def start_refresh(self, bucket: Bucket, chunk: torch.Tensor) -> "Refresh":
        """Start the all-gather of one bucket's updated chunk (an offloaded step overlaps it with the next
        bucket's CPU step); :meth:`finish_refresh` waits for what this returns."""
        # A copy, not the chunk itself: in fp32 the chunk aliases the all-gather's output.
        source, copied = copy_to_device(chunk, self.flat)
        return Refresh(comm.all_gather(self.bucket_view(bucket), source, group=self.group, async_op=True),
                       source, copied)

    @staticmethod
    def finish_refresh(pending: list["Refresh"]) -> None:
        for refresh in pending:
            refresh.wait()

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.flat]

    def set_param_value(self, slot, bucket, flat_value: torch.Tensor) -> None:
        """Every rank holds the full parameter: write all of it."""
        self.flat[slot.flat_start:slot.flat_end].copy_(flat_value)


def copy_into(dst: torch.Tensor, src: torch.Tensor):
    """``dst.copy_(src)``, asynchronous from pinned memory to an accelerator; returns the CUDA event marking
    when ``src`` has been read (the host buffer is written again soon), or None for a synchronous copy."""
    async_copy = src.is_pinned() and dst.is_cuda
    dst.copy_(src, non_blocking=async_copy)
    if not async_copy:
        return None
    copied = torch.cuda.Event()
    copied.record()
    return copied


def copy_to_device(values: torch.Tensor, like: torch.Tensor):
    """``(copy, event)``: ``values`` copied into a new tensor on ``like``'s device, in its dtype (see
    :func:`copy_into`)."""
    copy = torch.empty(values.shape, dtype=like.dtype, device=like.device)
    return copy, copy_into(copy, values)


@dataclass
class Refresh:
    """One bucket's updated values on their way into the parameters."""

    work: object  # the all-gather (None when synchronous)
    source: torch.Tensor  # kept alive until the collective is done
    copied: object = None  # CUDA event: the host values have been read

    def wait_read(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.wait_read()


def gather_chunk(params: list[torch.Tensor], bucket: Bucket, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor holding ``rank``'s chunk of ``bucket`` read from the (unflattened) ``params``; padding is 0."""
    device = params[bucket.slots[0].index].device
    chunk = torch.zeros(bucket.chunk_numel, dtype=dtype, device=device)
    with torch.no_grad():
        for piece in bucket.pieces_in_chunk(rank):
            chunk[piece.chunk_start:piece.chunk_start + piece.numel].copy_(
                params[piece.slot.index].detach().reshape(-1)[piece.param_start:piece.param_end])
    return chunk
