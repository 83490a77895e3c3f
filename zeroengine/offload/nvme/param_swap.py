"""Parameter offload to NVMe: stage 3's parameter chunks in a swap file, read when a gather needs them.

With ``offload_param.device: "nvme"`` a rank's chunk of every parameter bucket
(:class:`zeroengine.zero.partitioned_params.PartitionedParamBuffer`) lives in
``params.swp``, each bucket at a 4096-aligned offset, except the first buckets
whose chunks fit in ``max_in_cpu`` elements, which stay in host memory (as
DeepSpeed's ``max_in_cpu``). A gather reads the chunk into one of
``buffer_count`` host buffers (each at most ``buffer_size`` elements: a bucket's
chunk must fit) and all-gathers from it; the buffer goes back to the pool when
the collective is done, so a prefetch holds one while it is in flight and the
pool bounds the host memory reads take. The optimizer's updated values are
written back as each bucket is stepped, asynchronously; every read first waits
for the writes, so a gather never sees an old value.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from zeroengine.config.errors import ConfigError
from zeroengine.ops.aio import ALIGNMENT, AsyncIOHandle, aligned_empty

from .swap_folder import SwapFolder

PARAMS = "params.swp"


def _aligned_bytes(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass
class InCpuBudget:
    """``max_in_cpu``: parameter elements still allowed to stay in host memory, shared by the stage's buffers
    (trainable, frozen, each expert group's) in the order they are built."""

    left: int


class ParamSwapper:
    """Chunks ``numels[b]`` (in elements of ``dtype``) of a buffer's buckets, on the drive once ``budget`` (of
    ``max_in_cpu``) is spent."""

    def __init__(self, numels: list[int], dtype: torch.dtype, folder: SwapFolder, aio_args: dict,
                 buffer_count: int, buffer_size: int, budget: InCpuBudget, pin: bool, key: str):
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.folder = folder
        self.in_cpu: set[int] = set()
        for b, numel in enumerate(numels):  # the first buckets in layout order, while they fit
            if numel > budget.left:
                break
            self.in_cpu.add(b)
            budget.left -= numel
        self.numels = numels
        self.offsets: dict[int, int] = {}
        offset = 0
        for b, numel in enumerate(numels):
            if b not in self.in_cpu:
                self.offsets[b] = offset
                offset += _aligned_bytes(numel * self.itemsize)
        largest = max((numels[b] for b in self.offsets), default=0)
        if largest > buffer_size:
            raise ConfigError(key + ".buffer_size", f"{buffer_size} elements is less than this rank's largest "
                                                    f"parameter chunk ({largest} elements): raise buffer_size, or "
                                                    "lower zero_optimization.reduce_bucket_size")
        self.path = folder.reserve(PARAMS, offset) if self.offsets else None
        self.buffer_numel = _aligned_bytes(largest * self.itemsize) // self.itemsize
        self.buffer_count = buffer_count
        self.pin = pin
        self._free: list[torch.Tensor] = []  # pool buffers not in use (made when first needed)
        self._made = 0
        self._lent: deque = deque()  # (bucket, buffer) of gathers still reading their buffer
        self._read_io = AsyncIOHandle(**aio_args) if self.offsets else None
        self._write_io = AsyncIOHandle(**aio_args) if self.offsets else None
        self._writing = False
        # bytes moved; seconds waited for the drive (every read, writes that were not done yet); prefetches that
        # had to wait for another gather's read buffer
        self.stats = {"read_bytes": 0, "written_bytes": 0, "wait_s": 0.0, "waits_for_a_buffer": 0}

    def on_drive(self, b: int) -> bool:
        return b in self.offsets

    def drive_bytes(self) -> int:
        return sum(self.numels[b] * self.itemsize for b in self.offsets)

    # -- reads ------------------------------------------------------------------
    def take_buffer(self, finish_oldest) -> torch.Tensor:
        """A pool buffer; when all are lent, ``finish_oldest(bucket)`` completes the oldest gather using one."""
        if not self._free and self._made < self.buffer_count:
            self._free.append(aligned_empty(self.buffer_numel, self.dtype, self.pin))
            self._made += 1
        while not self._free:
            bucket, _ = self._lent[0]
            self.stats["waits_for_a_buffer"] += 1
            finish_oldest(bucket)  # gives its buffer back through give_back
        return self._free.pop()

    def lend(self, b: int, buffer: torch.Tensor) -> None:
        self._lent.append((b, buffer))

    def put_back(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)

    def give_back(self, b: int) -> None:
        """The gather of bucket b is done with its buffer."""
        for i, (lent_b, buffer) in enumerate(self._lent):
            if lent_b == b:
                del self._lent[i]
                self._free.append(buffer)
                return

    def read(self, b: int, buffer: torch.Tensor) -> torch.Tensor:
        """Bucket b's chunk read into ``buffer`` (after every pending write); returns the chunk's view of it."""
        self.wait_writes()
        numel = self.numels[b]
        whole = _aligned_bytes(numel * self.itemsize) // self.itemsize
        start = time.perf_counter()
        self._read_io.async_pread(buffer[:whole], self.path, self.offsets[b])
        self._read_io.wait()
        self.stats["wait_s"] += time.perf_counter() - start
        self.stats["read_bytes"] += whole * self.itemsize
        return buffer[:numel]

    def read_new(self, b: int) -> torch.Tensor:
        """Bucket b's chunk in a new tensor (for callers that keep it: masters, a checkpoint's values)."""
        whole = _aligned_bytes(self.numels[b] * self.itemsize) // self.itemsize
        return self.read(b, aligned_empty(whole, self.dtype, pin=False)).clone()  # compact: no alignment slack

    # -- writes -----------------------------------------------------------------
    def write(self, b: int, values: torch.Tensor):
        """Start writing ``values`` (bucket b's whole chunk, any float dtype) to the drive; returns a callable that
        waits until they are written (the caller may then reuse ``values``)."""
        if values.numel() != self.numels[b]:
            raise ValueError(f"bucket {b}: {values.numel()} values for a chunk of {self.numels[b]}")
        if values.dtype != self.dtype or values.device.type != "cpu" or not values.is_contiguous():
            values = values.detach().to(device="cpu", dtype=self.dtype).contiguous()
        self._write_io.async_pwrite(values, self.path, self.offsets[b])  # the handle keeps values alive
        self._writing = True
        self.stats["written_bytes"] += values.numel() * self.itemsize
        return self.wait_writes

    def wait_writes(self) -> None:
        if self._writing:
            self._writing = False
            start = time.perf_counter()
            self._write_io.wait()
            self.stats["wait_s"] += time.perf_counter() - start

    def pool_tensors(self) -> list[torch.Tensor]:
        return list(self._free) + [buffer for _, buffer in self._lent]

    def close(self) -> None:
        try:
            self.wait_writes()
        except RuntimeError:
            pass  # reported where it happened; the files go anyway
        self.folder.remove()
