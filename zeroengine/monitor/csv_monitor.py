"""CSV writer: one ``metrics.csv`` per job, one row per optimizer step, one column per metric.

Columns are ``step, samples, wall_time`` then the metric names of the first
step, in order (later steps fill the same columns; a metric missing from a
step leaves its cell empty). If ``metrics.csv`` already exists with the same
columns, rows are appended (a resumed run continues its curve, as DeepSpeed's
CSV monitor appends); with different columns, the old file is moved aside.
Floats are written with ``repr`` so they read back exactly.
"""
from __future__ import annotations

import csv
import os
import time

from zeroengine.progress import get_logger

from .base import Monitor, StepRecord

FILENAME = "metrics.csv"
LEADING_COLUMNS = ("step", "samples", "wall_time")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class CsvMonitor(Monitor):
    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, FILENAME)
        self._file = None
        self._writer = None
        self._columns: list[str] = []

    def write(self, record: StepRecord) -> None:
        if self._file is None:
            self._open(list(record.metrics))
        self._writer.writerow([record.step, record.samples, f"{record.wall_time:.3f}",
                               *(_cell(record.metrics.get(name)) for name in self._columns)])
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self, names: list[str]) -> None:
        header = [*LEADING_COLUMNS, *names]
        append = False
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as f:
                append = next(csv.reader(f), None) == header
            if not append:
                aside = f"{self.path}.{int(time.time())}.old"
                os.replace(self.path, aside)
                get_logger().info(f"monitor: {self.path} had other columns; moved it to {aside}")
        # Always append (O_APPEND): two writers on one file (a second initialize() into the same job) then
        # add rows after each other's instead of overwriting them from a stale position.
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)
        self._columns = names
        if not append:
            self._writer.writerow(header)
