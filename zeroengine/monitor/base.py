"""The Monitor interface, one step's record, and MonitorMaster (fan-out to every enabled writer).

Writers run on rank 0 only (every rank would write the same global numbers).
A writer that hits an OS error (disk full, directory removed) is dropped with
one warning rather than ending a long training run over a log file.
"""
from __future__ import annotations

import atexit
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from zeroengine.progress import get_logger


@dataclass
class StepRecord:
    """The metrics of one optimizer step (names: see zeroengine.monitor.recorder)."""

    step: int          # engine.global_steps after the step (1 for the first)
    samples: int       # engine.global_samples after the step
    wall_time: float   # seconds since the epoch
    metrics: dict[str, float] = field(default_factory=dict)


class Monitor(ABC):
    """One metrics writer (CSV, TensorBoard, ...)."""

    @abstractmethod
    def write(self, record: StepRecord) -> None:
        """Write one step; the data must be on disk (flushed) when this returns."""

    @abstractmethod
    def close(self) -> None:
        """Flush and close; safe to call more than once."""


class MonitorMaster:
    """Hands each step to every writer; closes them at exit if the user did not."""

    def __init__(self, monitors: list[Monitor]):
        self.monitors = list(monitors)
        self._closed = False
        if self.monitors:
            atexit.register(self.close)

    @property
    def active(self) -> bool:
        return bool(self.monitors)

    def write(self, record: StepRecord) -> None:
        for monitor in list(self.monitors):
            try:
                monitor.write(record)
            except OSError as err:
                get_logger().warning(f"monitor {type(monitor).__name__} stopped writing: {err}")
                self.monitors.remove(monitor)
                try:
                    monitor.close()
                except OSError:
                    pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for monitor in self.monitors:
            try:
                monitor.close()
            except OSError as err:
                get_logger().warning(f"monitor {type(monitor).__name__} did not close cleanly: {err}")
        atexit.unregister(self.close)
