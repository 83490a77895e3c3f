"""``zero.Init(remote_device="nvme")``: parameter slices written to a drive as the model is built.

Each parameter built under Init keeps only this rank's flat slice (see
:mod:`zeroengine.zero.init`); with ``remote_device="nvme"`` the slice goes
into a region of ``init.swp`` under ``offload_param.nvme_path`` instead of host
memory, and is read back when an init op or ``initialize()`` needs the
parameter's values. In 16-bit training ``initialize()`` also keeps this rank's
fp32 pieces of every parameter until the fp32 masters are made; those go to
the same kind of file. Regions are appended (a slice that changes dtype gets a
new one); the files are removed when the slices are released (``initialize()``)
or the process exits.
"""
from __future__ import annotations

import weakref

import torch

from zeroengine.ops.aio import ALIGNMENT, AsyncIOHandle

from .swap_folder import SwapFolder

KEY = "zero_optimization.offload_param.nvme_path"


class AppendSwap:
    """One file of regions appended one after the other; ``write`` returns where a tensor went, ``read`` gets
    it back. ``aio_args``: the handle's settings (the config's aio section)."""

    def __init__(self, nvme_path: str, aio_args: dict, name: str = "init.swp"):
        self.nvme_path, self.aio_args = nvme_path, aio_args
        self.folder = SwapFolder(nvme_path, KEY)
        self.path = self.folder.reserve(name, 0)
        self.io = AsyncIOHandle(**aio_args)
        self.end = 0
        self.bytes_written = 0
        self._closed = weakref.finalize(self, self.folder.remove)

    def write(self, values: torch.Tensor) -> tuple[int, torch.dtype, int]:
        """Append ``values`` (any CPU-readable tensor); returns its region (offset, dtype, numel)."""
        values = values.detach().to("cpu").contiguous().reshape(-1)
        offset = self.end
        nbytes = values.numel() * values.element_size()
        self.end += -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
        self.io.async_pwrite(values, self.path, offset)
        self.io.wait()
        self.bytes_written += nbytes
        return offset, values.dtype, values.numel()

    def rewrite(self, region: tuple[int, torch.dtype, int], values: torch.Tensor) -> None:
        """Overwrite a region with values of its dtype and size."""
        offset, dtype, numel = region
        values = values.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1)
        if values.numel() != numel:
            raise ValueError(f"{numel} elements expected, got {values.numel()}")
        self.io.async_pwrite(values, self.path, offset)
        self.io.wait()

    def read(self, region: tuple[int, torch.dtype, int]) -> torch.Tensor:
        offset, dtype, numel = region
        out = torch.empty(numel, dtype=dtype)
        if numel:
            self.io.async_pread(out, self.path, offset)
            self.io.wait()
        return out

    def sibling(self, name: str) -> "AppendSwap":
        """Another file under the same nvme_path, with the same I/O settings (a folder of its own)."""
        return AppendSwap(self.nvme_path, self.aio_args, name)

    def close(self) -> None:
        self._closed()
