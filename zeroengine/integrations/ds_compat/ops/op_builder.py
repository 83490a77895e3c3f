"""``deepspeed.ops.op_builder``: the builders scripts load ops through (``AsyncIOBuilder().load().aio_handle``)."""
from __future__ import annotations

from types import SimpleNamespace

from zeroengine.ops import aio
from zeroengine.ops.op_builders import AsyncIOBuilder as _AsyncIOBuilder


class AsyncIOBuilder:
    """DeepSpeed's builder of its async I/O op; ``load()`` gives a module whose ``aio_handle`` is
    :class:`zeroengine.ops.aio.AsyncIOHandle` (the C++ op when it builds, else the Python reference)."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True  # the Python reference runs wherever the op does not build

    def load(self, verbose: bool = True):
        return SimpleNamespace(aio_handle=aio.AsyncIOHandle, __name__="async_io")

    def op_status(self) -> dict:
        return _AsyncIOBuilder().status()
