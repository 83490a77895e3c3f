"""``deepspeed.accelerator.get_accelerator()``: the device the engine trains on, as DeepSpeed's accelerator
object describes it (transformers and accelerate ask it for device names and to empty caches).

zeroengine trains on CUDA when it is available (NCCL) and on the CPU otherwise (gloo), the same rule as
:func:`zeroengine.comm.default_backend`; this object answers for that device.
"""
from __future__ import annotations

import os

import torch

from zeroengine.comm import default_backend


class _Accelerator:
    """DeepSpeed's accelerator interface, for the CUDA or CPU device zeroengine uses."""

    def __init__(self, cuda: bool):
        self._cuda = cuda
        self._name = "cuda" if cuda else "cpu"

    def device_name(self, device_index=None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return default_backend()

    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def manual_seed(self, seed) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def __repr__(self) -> str:
        return f"<zeroengine accelerator: {self._name}>"


_accelerator: _Accelerator | None = None


def get_accelerator() -> _Accelerator:
    global _accelerator
    if _accelerator is None:
        _accelerator = _Accelerator(torch.cuda.is_available())
    return _accelerator
