"""ZeRO stages 1-3 on CPU, when memory matters more than speed: freed memory goes back to the OS.

Why: on an accelerator, freeing a gathered bucket is a resize of its storage
to 0 bytes, served by the caching allocator. On CPU every free goes through
glibc's malloc, which keeps freed blocks in its heap: glibc raises its mmap
threshold each time a large block is freed (up to 32 MiB), after which
gathered buckets, gradients and optimizer temporaries are carved from a heap
that is only trimmed at its top. Measured on a 16-layer model (64 MiB of
weights) on 4 ranks: each rank's resident memory reached 152-211 MiB where
the live state was 64 MiB of model states plus a few layers' transients
(100 MiB at the peak once freed memory goes back).

Opt-in, because returning memory is paid in page faults at every re-use:
on the 26M-param GPT of benchmarks/bench_stages.py (2 ranks, 2 shared cores)
it cut stage 3's peak RSS from 888 to 683 MiB per rank (growth 2.9x -> 1.09x
the 16Ψ/N formula, the lowest of all variants) but took 5x the page faults
and 2x the step time. At stage 2 on the same model it brings the raw RSS growth below DeepSpeed's
stage 2 (docs/benchmarks.md). ``ZEROENGINE_MALLOC_MMAP_THRESHOLD=<bytes>`` (e.g.
1048576) turns it on, with two measures (the second at stage 3 only):

* glibc's mmap threshold is fixed at that size (``mallopt``; fixing it also
  stops the dynamic raising), so large transients are mapped and unmapped
  rather than parked in the heap; a process-wide setting, made once and
  logged; a user who set ``MALLOC_MMAP_THRESHOLD_`` keeps theirs;
* gather buffers keep their storage for the buffer's lifetime (views autograd
  saved in forward stay valid, as with the resize scheme) and a release hands
  the storage's pages back (``madvise(MADV_DONTNEED)``): the next gather's
  writes fault in zero pages.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4  # linux/mman.h; the same value on every Linux architecture torch supports
_M_MMAP_THRESHOLD = -3  # malloc.h
_PAGE = mmap.PAGESIZE
_libc = None
_threshold_set = None  # the threshold this process set, once set


def _c_library():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):  # not a POSIX C library with madvise
            _libc = False
    return _libc


def can_drop_pages(tensor: torch.Tensor) -> bool:
    """Whether :func:`drop_pages` can release ``tensor``'s memory (plain CPU memory, a C library with madvise)."""
    return tensor.device.type == "cpu" and not tensor.is_pinned() and bool(_c_library())


def drop_pages(tensor: torch.Tensor) -> int:
    """Return the whole pages inside ``tensor``'s storage to the OS; its contents read as zeros afterwards.

    Returns the bytes released. The partial pages at either end stay: they may hold the
    allocator's bookkeeping or a neighbouring allocation.
    """
    storage = tensor.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    first = -(-start // _PAGE) * _PAGE
    last = (start + nbytes) // _PAGE * _PAGE
    if last <= first:
        return 0
    if _c_library().madvise(first, last - first, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a stage-3 gather buffer")
    return last - first


def return_freed_memory() -> bool:
    """Whether stage 3 on CPU gives freed memory back to the OS (``ZEROENGINE_MALLOC_MMAP_THRESHOLD`` > 0)."""
    return _threshold_set is not None


def map_large_allocations() -> int | None:
    """Fix glibc's mmap threshold when asked (see the module note); the threshold set, or None if left alone."""
    global _threshold_set
    if _threshold_set is not None:
        return _threshold_set
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # the user chose
        return None
    raw = os.environ.get("ZEROENGINE_MALLOC_MMAP_THRESHOLD", "0")
    try:
        threshold = int(raw)
    except ValueError:
        raise ValueError(f"ZEROENGINE_MALLOC_MMAP_THRESHOLD must be a byte count (0, the default, leaves malloc alone), "
                         f"got {raw!r}") from None
    libc = _c_library()
    if threshold <= 0 or not libc or not hasattr(libc, "mallopt") or libc.mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return None  # not glibc (mallopt missing or refusing): nothing to tune
    _threshold_set = threshold
    logger.info("ZeRO on CPU: glibc's mmap threshold fixed at %d bytes (ZEROENGINE_MALLOC_MMAP_THRESHOLD): freed "
                "parameters, gradients and temporaries return to the OS, at the cost of page faults", threshold)
    return threshold
