"""Checkpoints that do not stall training: ``checkpoint.async_save`` / ``save_checkpoint(async_save=True)``.

The save's collective part runs as usual (the ranks agree on the tag, stage 3 gathers what the optimizer does
not hold); then every tensor of this rank's payloads is copied into host buffers that are kept from one save to
the next (pinned when the tensors live on a GPU, so the copy is a DMA), and a background thread writes, fsyncs,
reports and commits while training goes on. The commit protocol is the synchronous one
(:func:`zeroengine.checkpoint.save.write_and_commit`, which meets the other ranks through the store only):
``latest`` moves once every rank's files are on disk, and a crash before that leaves the previous checkpoint
the latest. One save is in flight at a time: the next save, a load, :meth:`BackgroundSaver.wait`
(``engine.wait_for_checkpoint()``) and ``engine.destroy()`` wait for it, and raise its error if it failed. The
writer thread is not a daemon, so a script that ends meanwhile still commits before the interpreter exits.
"""
from __future__ import annotations

import os
import threading

import torch

from .files import CheckpointError
from .save import SaveJob, write_and_commit


class SnapshotBuffers:
    """Host copies of a save's tensors, reused by the next save when the tensor at the same place in the
    payload has the same shape and dtype (the usual case: the same model saved every K steps)."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers)

    def snapshot(self, payload):
        """``payload`` with every tensor replaced by its copy in a buffer (containers rebuilt, so later changes
        to the live dicts and lists do not reach the save either)."""
        self._next = 0
        return self._copy(payload)

    def _copy(self, obj):
        if isinstance(obj, torch.Tensor):
            return self._take(obj).copy_(obj.detach(), non_blocking=obj.is_cuda)
        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            copied = [self._copy(v) for v in obj]
            return copied if isinstance(obj, list) else tuple(copied)
        return obj

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        if i < len(self._buffers):
            buffer = self._buffers[i]
            if buffer.shape == like.shape and buffer.dtype == like.dtype:
                return buffer
        buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)
        if i < len(self._buffers):
            self._buffers[i] = buffer
        else:
            self._buffers.append(buffer)
        return buffer


def _lower_priority() -> None:
    """Give the writer thread a lower CPU priority (nice +10; Linux applies it to the thread alone): serializing
    and checksumming the files should take the cores training leaves idle, not the training loop's share."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except (AttributeError, OSError):  # not Linux, or not allowed: the writer runs at the same priority
        pass


class BackgroundSaver:
    """The engine's asynchronous saves: at most one in flight (see the module doc)."""

    def __init__(self):
        self.buffers = SnapshotBuffers()
        self._thread: threading.Thread | None = None
        self._job: SaveJob | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, job: SaveJob) -> str:
        """Snapshot ``job``'s tensors, then write and commit it in the background; returns the tag directory
        the save will have once committed."""
        self.wait()
        job.shard, job.common = self.buffers.snapshot((job.shard, job.common))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies into pinned memory are asynchronous
        self._job, self._error = job, None
        self._thread = threading.Thread(target=self._run, args=(job,), name="zeroengine-checkpoint-writer")
        self._thread.start()
        return os.path.join(job.save_dir, job.tag)

    def _run(self, job: SaveJob) -> None:
        _lower_priority()
        try:
            write_and_commit(job)
        except BaseException as err:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = err

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        if self._thread is None:
            return
        self._thread.join()
        thread_error, job = self._error, self._job
        self._thread, self._job, self._error = None, None, None
        if thread_error is not None:
            raise CheckpointError(f"the background save of checkpoint {job.tag!r} in {job.save_dir} failed "
                                  f"(latest still names the previous one): {thread_error}") from thread_error
