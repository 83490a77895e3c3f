"""Accounting of the bytes a rank holds, by kind and by where they live.

``Engine.memory_breakdown()`` returns the dict built here; docs/concepts.md's memory
formulas are checked against it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

KINDS = ("params", "grads", "optimizer_states", "master_params", "buffers")


class MemoryTally:
    """Adds up the storages behind tensors, each storage once.

    Counting storages (not tensor sizes) is what "held" means: a view into a
    flat buffer holds nothing extra, and a flat buffer is held in full however
    it is viewed. A storage counts under the first kind it is added with.
    """

    def __init__(self) -> None:
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.by_place = {"cpu": 0, "device": 0, "nvme": 0}
        self._seen: set[tuple[int, str]] = set()

    def add(self, kind: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device.type) if storage.nbytes() else (id(t), "empty")
            if key in self._seen:
                continue
            self._seen.add(key)
            nbytes = storage.nbytes()
            self.by_kind[kind] += nbytes
            self.by_place["cpu" if t.device.type == "cpu" else "device"] += nbytes

    def add_bytes(self, kind: str, place: str, nbytes: int) -> None:
        """Bytes held outside any tensor: NVMe offload's swap files."""
        self.by_kind[kind] += nbytes
        self.by_place[place] += nbytes

    def add_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            self.add("optimizer_states", (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0))

    def as_dict(self) -> dict[str, int]:
        return {**self.by_kind, **self.by_place}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}GiB"
