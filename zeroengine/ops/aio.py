"""Asynchronous reads and writes of tensors to files: the I/O under NVMe offload, with DeepSpeed's ``aio_handle``.

``AsyncIOHandle`` queues requests (a whole tensor from or to a file range) and returns at once; ``wait()``
blocks until all of them are done and returns how many completed, or raises one error naming every file that
failed. Requests run on the ``async_io`` op (ops/csrc/aio/async_io_cpu.cpp: threads in pread/pwrite, O_DIRECT
where buffer, length and offset are 4096-aligned) when it builds, else on the pure-Python reference below (the
same threads with ``os.pread``/``os.pwrite``, through the page cache) after one warning; ``impl`` picks one.
``new_cpu_locked_tensor`` gives buffers aligned for O_DIRECT (pinned on a CUDA machine, so copies to and from
the device are DMA).

DeepSpeed's names and meanings: ``block_size`` (bytes per I/O), ``queue_depth`` (requests in flight per
thread), ``intra_op_parallelism`` (its ``thread_count``); ``single_submit`` and ``overlap_events`` are
libaio submission details, accepted and reported, with no effect on a thread pool.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from zeroengine.ops.builder import load_kernel
from zeroengine.ops.op_builders import AsyncIOBuilder

ALIGNMENT = 4096  # O_DIRECT's: buffer address, length and file offset
MAX_THREADS = 64


class ReferenceAsyncIO:
    """The op's contract in Python: ``submit`` queues, ``wait`` returns the count or raises naming each file."""

    def __init__(self, block_size: int, queue_depth: int, thread_count: int):
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth), ("thread_count", thread_count)):
            if value <= 0:
                raise RuntimeError(f"aio: {name} must be positive, got {value}")
        self._block_size = block_size
        self._pool = ThreadPoolExecutor(max_workers=min(MAX_THREADS, queue_depth * thread_count))
        self._requests: list[tuple[str, int, list]] = []  # (path, fd, its pieces' futures)
        self._lock = threading.Lock()

    def submit(self, buffer: torch.Tensor, path: str, file_offset: int, write: bool) -> None:
        if buffer.device.type != "cpu":
            raise RuntimeError(f"aio: the buffer must be a CPU tensor (got {buffer.device})")
        if not buffer.is_contiguous():
            raise RuntimeError("aio: the buffer must be contiguous")
        if file_offset < 0:
            raise RuntimeError(f"aio: file_offset must be >= 0, got {file_offset}")
        try:
            fd = os.open(path, (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY, 0o644)
        except OSError as err:
            raise RuntimeError(f"aio: cannot open {path} for {'writing' if write else 'reading'}: "
                               f"{err.strerror} (errno {err.errno})") from None
        data = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        if not write:
            size = os.fstat(fd).st_size
            if size < file_offset + len(data):
                os.close(fd)
                raise RuntimeError(f"aio: {path} has {size} bytes; reading {len(data)} at offset {file_offset} "
                                   f"needs {file_offset + len(data)}")
        pieces = [self._pool.submit(self._serve, fd, data[start:start + self._block_size], file_offset + start, write)
                  for start in range(0, len(data), self._block_size)]
        with self._lock:
            self._requests.append((path, fd, pieces))

    @staticmethod
    def _serve(fd: int, piece: memoryview, offset: int, write: bool) -> None:
        done = 0
        while done < len(piece):
            n = (os.pwrite(fd, piece[done:], offset + done) if write
                 else os.preadv(fd, [piece[done:]], offset + done))
            if n == 0:
                raise OSError(f"the file ends before offset {offset + len(piece)}")
            done += n

    def wait(self) -> int:
        with self._lock:
            requests, self._requests = self._requests, []
        errors = []
        for path, fd, pieces in requests:
            failure = None
            for piece in pieces:
                try:
                    piece.result()
                except OSError as err:
                    failure = failure or (f"{err.strerror} (errno {err.errno})" if err.errno else str(err))
            os.close(fd)
            if failure:
                errors.append(f"{path}: {failure}")
        if errors:
            raise RuntimeError(f"aio: {len(errors)} of {len(requests)} request(s) failed:\n  " + "\n  ".join(errors))
        return len(requests)


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool | None = None) -> torch.Tensor:
    """A CPU tensor whose data starts on an ALIGNMENT boundary (pinned where CUDA is, by default)."""
    pin = torch.cuda.is_available() if pin is None else pin
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * itemsize + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip:skip + numel * itemsize].view(dtype)


class AsyncIOHandle:
    """DeepSpeed's ``aio_handle`` (see the module doc). ``backend``: ``"cpp"`` or ``"python"``."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1, *, impl: str = "auto"):
        if impl not in ("auto", "cpp", "python"):
            raise ValueError(f"impl must be 'auto', 'cpp' or 'python', got {impl!r}")
        kernel = None if impl == "python" else load_kernel(AsyncIOBuilder(), impl == "cpp", "AsyncIOHandle",
                                                             "the Python thread-pool reference (no O_DIRECT)")
        args = (int(block_size), int(queue_depth), int(intra_op_parallelism))
        self._io = kernel.AsyncIO(*args) if kernel is not None else ReferenceAsyncIO(*args)
        self.backend = "cpp" if kernel is not None else "python"
        self._settings = {"block_size": int(block_size), "queue_depth": int(queue_depth),
                          "single_submit": bool(single_submit), "overlap_events": bool(overlap_events),
                          "intra_op_parallelism": int(intra_op_parallelism)}
        self._in_flight: list[torch.Tensor] = []  # kept alive until wait(): the threads write into them

    def get_block_size(self) -> int:
        return self._settings["block_size"]

    def get_queue_depth(self) -> int:
        return self._settings["queue_depth"]

    def get_single_submit(self) -> bool:
        return self._settings["single_submit"]

    def get_overlap_events(self) -> bool:
        return self._settings["overlap_events"]

    def get_intra_op_parallelism(self) -> int:
        return self._settings["intra_op_parallelism"]

    def get_thread_count(self) -> int:
        return self._settings["intra_op_parallelism"]

    def get_alignment(self) -> int:
        return ALIGNMENT

    def _submit(self, buffer: torch.Tensor, filename, file_offset: int, write: bool) -> None:
        self._io.submit(buffer, os.fspath(filename), int(file_offset), write)
        self._in_flight.append(buffer)

    def async_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        self._submit(buffer, filename, file_offset, write=False)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        self._submit(buffer, filename, file_offset, write=True)
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        self.async_pread(buffer, filename, file_offset)
        return self.wait()

    def sync_pwrite(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        self.async_pwrite(buffer, filename, file_offset)
        return self.wait()

    def pread(self, buffer: torch.Tensor, filename, validate: bool = False, async_op: bool = False,
              file_offset: int = 0, **kwargs) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async, file_offset)`` (``async`` positionally or as
        ``async_op``); ``validate`` is accepted (the reads are checked for length either way)."""
        async_op = kwargs.pop("async", async_op)
        return self.async_pread(buffer, filename, file_offset) if async_op else self.sync_pread(buffer, filename,
                                                                                                file_offset)

    def pwrite(self, buffer: torch.Tensor, filename, validate: bool = False, async_op: bool = False,
               file_offset: int = 0, **kwargs) -> int:
        async_op = kwargs.pop("async", async_op)
        return self.async_pwrite(buffer, filename, file_offset) if async_op else self.sync_pwrite(buffer, filename,
                                                                                                  file_offset)

    def read(self, buffer: torch.Tensor, filename, validate: bool = False, file_offset: int = 0) -> int:
        return self.sync_pread(buffer, filename, file_offset)

    def write(self, buffer: torch.Tensor, filename, validate: bool = False, file_offset: int = 0) -> int:
        return self.sync_pwrite(buffer, filename, file_offset)

    def wait(self) -> int:
        """Block until every request submitted so far is done; how many completed since the last wait."""
        try:
            return self._io.wait()
        finally:
            self._in_flight.clear()

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return aligned_empty(int(num_elem), example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return True  # freed when the last reference goes

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a buffer the op reads and writes directly (O_DIRECT-aligned CPU memory)."""
        return tensor.device.type == "cpu" and tensor.data_ptr() % ALIGNMENT == 0
