"""Group many small tensors into a few large collectives.

One collective per parameter would pay the per-message latency thousands of
times per step; one collective for the whole model would need a second copy of
every gradient. Buckets of ``bucket_bytes`` bound that extra copy while keeping
the message count small.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import collectives


def iter_buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors whose total size stays within ``bucket_bytes``.

    A tensor larger than the bucket gets a bucket of its own.
    """
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def all_reduce_mean_in_buckets(
    tensors: list[torch.Tensor],
    bucket_bytes: int,
    group=None,
    comm_dtype: torch.dtype | None = None,
    divisor: int | None = None,
) -> None:
    """Average ``tensors`` across the group in place, bucket by bucket.

    The sum is taken first and divided after (DeepSpeed's default
    "postscale"), so fp32 results are the plain mean up to summation order.
    ``comm_dtype`` lets 16-bit gradients travel in fp32 when asked for.
    ``divisor`` replaces the group size as the denominator (MoE expert
    gradients: summed over their expert-data-parallel group, averaged over the world).
    """
    world = collectives.dist.get_world_size(group)
    divisor = divisor or world
    if world == 1:
        if divisor != 1:
            torch._foreach_div_(tensors, divisor)
        return
    for bucket in iter_buckets(tensors, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        if comm_dtype is not None and flat.dtype != comm_dtype:
            flat = flat.to(comm_dtype)
        collectives.all_reduce(flat, group=group)
        flat.div_(divisor)
        for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            dst.copy_(src)


@torch.no_grad()
def broadcast_in_buckets(tensors: list[torch.Tensor], src: int, bucket_bytes: int = 32 * 2**20, group=None) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with global rank ``src``'s values, a few collectives."""
    for bucket in iter_buckets(tensors, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        collectives.broadcast(flat, src=src, group=group)
        for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(value)
