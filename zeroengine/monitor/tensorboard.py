"""TensorBoard writer: an ``events.out.tfevents.*`` file written without the tensorboard package.

The file is a TFRecord stream (:mod:`.tfrecord`) of ``Event`` protobufs
(:mod:`.event_proto`): first the ``file_version`` event TensorBoard expects,
then one event per optimizer step whose Summary holds every metric as a
``simple_value`` scalar (tag = metric name). Each write is flushed, so a
TensorBoard pointed at a live run sees each step as it lands.
"""
from __future__ import annotations

import os
import socket
import time

from .base import Monitor, StepRecord
from .event_proto import FILE_VERSION, Event, decode_event, encode_event
from .tfrecord import read_records, write_record


def event_file_name(now: float | None = None, serial: int = 0) -> str:
    # "tfevents" in the name is what TensorBoard looks for; host and pid keep concurrent runs apart, and
    # the serial two writers of one process in the same second (a second initialize(), as torch's writer).
    stamp = int(time.time() if now is None else now)
    return f"events.out.tfevents.{stamp}.{socket.gethostname()}.{os.getpid()}.{serial}"


class TensorBoardMonitor(Monitor):
    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        now = time.time()
        serial = 0
        while True:  # exclusive create: never truncate another writer's file
            self.path = os.path.join(directory, event_file_name(now, serial))
            try:
                self._file = open(self.path, "xb")
                break
            except FileExistsError:
                serial += 1
        write_record(self._file, encode_event(Event(wall_time=now, file_version=FILE_VERSION)))
        self._file.flush()

    def write(self, record: StepRecord) -> None:
        event = Event(wall_time=record.wall_time, step=record.step, scalars=dict(record.metrics))
        write_record(self._file, encode_event(event))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_event_file(path: str) -> list[Event]:
    """Every event of one file, checksums verified (the file_version event first)."""
    with open(path, "rb") as f:
        return [decode_event(payload) for payload in read_records(f)]


def read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from one event file."""
    out: dict[str, list[tuple[int, float]]] = {}
    for event in read_event_file(path):
        for tag, value in event.scalars.items():
            out.setdefault(tag, []).append((event.step, value))
    return out
