"""Optimizer offload to NVMe: the offloaded buckets' fp32 masters and optimizer state live in swap files.

With ``offload_optimizer.device: "nvme"`` a rank's offloaded buckets (see
:mod:`zeroengine.offload.placement`) keep nothing in host memory between
steps. Each bucket's chunk of fp32 masters and each of its per-element
optimizer states (Adam's ``exp_avg`` and ``exp_avg_sq``) is one region of a
swap file: ``masters.swp`` holds region 0 of every bucket, ``state1.swp`` the
first state, and so on, each bucket at the same 4096-aligned offset in every
file, so reads and writes go through O_DIRECT (:mod:`zeroengine.ops.aio`).

Between steps a swapped-out bucket's master chunk, its pieces (the optimizer's
params) and their state tensors point at an empty tensor: the Python objects
stay (the optimizer's param groups and state dict keep their keys), the memory
does not. The offloaded step (:mod:`zeroengine.offload.step`) streams the
buckets through a pool of ``buffer_count`` host buffers (slots), each one
bucket's regions, each with its own I/O queue:

* ``bring_in(i)`` waits for the i-th bucket's read and points its tensors at
  the slot; with ``pipeline_read`` the next ``buffer_count - 2`` buckets are
  already being read into other slots (``buffer_count - 1`` without
  ``pipeline_write``);
* after the CPU optimizer stepped it, ``send_out(i)`` copies any state the
  optimizer made itself (at the first step) into the slot, empties the tensors
  and writes the slot back; with ``pipeline_write`` the write runs while the
  next bucket steps, and the slot is read into again only after it finished.

Host memory is therefore the pool: ``buffer_count`` x (1 + states) x a bucket's
chunk, in fp32, whatever the model size (``memory_breakdown()`` counts it as
buffers, the files as ``nvme``). A checkpoint save or load, and a
GatheredParameters edit, need the values of every bucket at once: those bring
the rank's whole offloaded shard into fresh host memory (``materialize_all``),
and give it back afterwards (``release_all``), writing it out when it changed.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from zeroengine.ops.aio import ALIGNMENT, AsyncIOHandle, aligned_empty

from .swap_folder import SwapFolder

FLOAT_BYTES = 4
_ALIGN_NUMEL = ALIGNMENT // FLOAT_BYTES
MASTERS = "masters.swp"


def aligned_numel(numel: int) -> int:
    """``numel`` fp32 elements rounded up to whole O_DIRECT blocks."""
    return -(-numel // _ALIGN_NUMEL) * _ALIGN_NUMEL


def region_file(k: int) -> str:
    """The swap file of region ``k``: 0 the masters, k >= 1 the k-th optimizer state."""
    return MASTERS if k == 0 else f"state{k}.swp"


def expected_state_count(optimizer: torch.optim.Optimizer) -> int:
    """Per-element state tensors ``optimizer`` keeps (sizes the pool and the up-front disk check; a slot
    grows if the first step shows more)."""
    defaults = optimizer.defaults
    name = type(optimizer).__name__.lower()
    if "adam" in name:
        return 3 if defaults.get("amsgrad") else 2
    if name == "sgd":
        return 1 if defaults.get("momentum") else 0
    return 2


class _Slot:
    """A host buffer holding one bucket's regions (``region_numel`` elements each), and the I/O on it."""

    def __init__(self, region_numel: int, regions: int, io: AsyncIOHandle, pin: bool):
        self.region_numel = region_numel
        self.pin = pin
        self.buffer = aligned_empty(region_numel * regions, torch.float32, pin)
        self.io = io
        self.bucket: int | None = None  # the bucket read into it (or being written from it)
        self.reading = False  # a read was submitted and not yet waited for
        self.writing = False
        self.reader = None  # waits until a send of the values in this slot has read them (fp32 training)

    @property
    def regions(self) -> int:
        return self.buffer.numel() // self.region_numel

    def region(self, k: int, numel: int) -> torch.Tensor:
        start = k * self.region_numel
        return self.buffer[start:start + numel]

    def grow(self, regions: int) -> None:
        """At least ``regions`` regions, keeping what the present ones hold."""
        if regions <= self.regions:
            return
        bigger = aligned_empty(self.region_numel * regions, torch.float32, self.pin)
        bigger[:self.buffer.numel()].copy_(self.buffer)
        self.buffer = bigger

    def wait_free(self) -> float:
        """Until nothing reads or writes the slot: its write is done and its values were sent. Returns the
        seconds it waited for the drive."""
        waited = self.wait_io() if self.reading or self.writing else 0.0
        reader, self.reader = self.reader, None
        if reader is not None:
            reader()
        return waited

    def wait_io(self) -> float:
        """Until the slot's read or write is done; the seconds it took."""
        start = time.perf_counter()
        self.io.wait()
        self.reading = self.writing = False
        return time.perf_counter() - start


class OptimizerSwapper:
    """Keeps buckets ``buckets``' masters (``chunks[b]``), pieces (``pieces[b]``) and their optimizer state in
    files under ``folder``, streamed through ``buffer_count`` slots. ``numels[b]``: bucket b's chunk size;
    ``wheres[b]``: its pieces' places in the chunk (``chunk_start``, ``numel``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: list, pieces: list, wheres: dict, numels: dict,
                 buckets: list[int], folder: SwapFolder, aio_args: dict, buffer_count: int,
                 pipeline_read: bool, pipeline_write: bool, pin: bool):
        self.optimizer = optimizer
        self.chunks, self.pieces, self.wheres, self.numels = chunks, pieces, wheres, numels
        self.buckets = sorted(buckets)
        self.folder = folder
        self.aio_args = aio_args
        self.pin = pin
        self.pipeline_write = pipeline_write
        self.offsets: dict[int, int] = {}  # bucket -> byte offset of its regions in every swap file
        offset = 0
        for b in self.buckets:
            self.offsets[b] = offset
            offset += aligned_numel(numels[b]) * FLOAT_BYTES
        self.file_bytes = offset
        self.region_numel = max((aligned_numel(numels[b]) for b in self.buckets), default=0)
        # Per bucket, per piece: the names of its swapped state tensors (region k + 1 holds keys[k]).
        self.keys: list[str] = []  # state names in region order, over every bucket
        self.piece_keys: dict[int, list[tuple[str, ...]]] = {b: [() for _ in wheres[b]] for b in self.buckets}
        self.written: set[int] = set()  # buckets whose masters are in the files
        self.state_count = expected_state_count(optimizer)
        self.paths = {0: folder.reserve(MASTERS, self.file_bytes)}
        for k in range(1, 1 + self.state_count):  # reserved now: a drive too small fails before training
            self.paths[k] = folder.reserve(region_file(k), self.file_bytes)
        self.slots = [_Slot(self.region_numel, 1 + self.state_count, AsyncIOHandle(**aio_args), pin)
                      for _ in range(buffer_count)]
        # How many buckets ahead of the one stepping are read: the slots not stepping, less one for the
        # write in flight when writes overlap.
        spare = buffer_count - 1 - (1 if pipeline_write else 0)
        self.read_ahead = max(0, spare) if pipeline_read else 0
        self._bulk_io: AsyncIOHandle | None = None
        self.materialized: dict[int, _Slot] = {}  # bucket -> the fresh buffer it lives in (checkpoints)
        self._order: list[int] = []
        self._issued = 0  # reads submitted so far in this pass
        # bytes moved, and seconds the step waited for the drive (a read not ready, a slot still being written)
        self.stats = {"read_bytes": 0, "written_bytes": 0, "wait_s": 0.0}

    # -- the files --------------------------------------------------------------
    def store_initial(self, b: int) -> None:
        """Write bucket b's freshly made masters (``chunks[b]``) to the drive and let them go (at construction:
        one bucket at a time, so the masters never all exist in host memory)."""
        slot = self._bulk_slot(b, 1)
        slot.region(0, self.numels[b]).copy_(self.chunks[b])
        self._write(slot, b, ())
        slot.io.wait()
        self._detach(b)

    def _bulk_slot(self, b: int, regions: int) -> _Slot:
        """A buffer outside the pool, of bucket b's size (one bucket at a time, or every one for a checkpoint)."""
        if self._bulk_io is None:
            self._bulk_io = AsyncIOHandle(**self.aio_args)
        return _Slot(aligned_numel(self.numels[b]), regions, self._bulk_io, pin=False)

    def _region_count(self, b: int) -> int:
        """Regions bucket b has in the files: the masters, and each state any of its pieces keeps."""
        used = {key for keys in self.piece_keys[b] for key in keys}
        return 1 + max((self.keys.index(key) + 1 for key in used), default=0)

    def _read(self, slot: _Slot, b: int) -> None:
        numel = aligned_numel(self.numels[b])
        regions = self._region_count(b)
        slot.grow(regions)
        for k in range(regions):
            slot.io.async_pread(slot.region(k, numel), self.paths[k], self.offsets[b])
        slot.bucket, slot.reading = b, True
        self.stats["read_bytes"] += regions * numel * FLOAT_BYTES

    def _write(self, slot: _Slot, b: int, keys: tuple[str, ...]) -> None:
        numel = aligned_numel(self.numels[b])
        regions = 1 + (max(self.keys.index(key) + 1 for key in keys) if keys else 0)
        for k in range(regions):
            if k not in self.paths:
                self.paths[k] = self.folder.reserve(region_file(k), self.file_bytes)
            slot.io.async_pwrite(slot.region(k, numel), self.paths[k], self.offsets[b])
        slot.bucket, slot.writing = b, True
        self.written.add(b)
        self.stats["written_bytes"] += regions * numel * FLOAT_BYTES

    # -- pointing the tensors at a slot and away ---------------------------------
    def _attach(self, b: int, slot: _Slot) -> None:
        numel = self.numels[b]
        chunk = slot.region(0, numel)
        self.chunks[b] = chunk
        state = self.optimizer.state
        for where, piece, keys in zip(self.wheres[b], self.pieces[b], self.piece_keys[b]):
            lo, hi = where.chunk_start, where.chunk_start + where.numel
            piece.data = chunk[lo:hi]
            for key in keys:
                state[piece][key] = slot.region(self.keys.index(key) + 1, numel)[lo:hi]

    def _detach(self, b: int) -> None:
        empty = torch.empty(0)
        self.chunks[b] = empty
        state = self.optimizer.state
        for piece, keys in zip(self.pieces[b], self.piece_keys[b]):
            piece.data = empty
            for key in keys:
                state[piece][key] = empty

    def _collect(self, b: int, slot: _Slot) -> tuple[str, ...]:
        """Put bucket b's current masters and per-element state into ``slot``'s regions (where the optimizer
        or a checkpoint load made new state tensors, or the slot grew); record which states each piece has."""
        numel = self.numels[b]
        state = self.optimizer.state
        per_piece = []
        for piece in self.pieces[b]:
            keys = tuple(k for k, v in state.get(piece, {}).items()
                         if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == piece.numel()
                         and v.dtype == torch.float32)
            for key in keys:
                if key not in self.keys:
                    self.keys.append(key)
            per_piece.append(keys)
        used = tuple(dict.fromkeys(key for keys in per_piece for key in keys))
        slot.grow(1 + max((self.keys.index(key) + 1 for key in used), default=0))
        master = slot.region(0, numel)
        if self.chunks[b].data_ptr() != master.data_ptr():
            master.copy_(self.chunks[b])
        for where, piece, keys in zip(self.wheres[b], self.pieces[b], per_piece):
            lo, hi = where.chunk_start, where.chunk_start + where.numel
            for key in keys:
                dst = slot.region(self.keys.index(key) + 1, numel)[lo:hi]
                src = state[piece][key]
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src.reshape(-1))
        self.piece_keys[b] = per_piece
        return used

    # -- the streamed step --------------------------------------------------------
    def start(self, order: list[int]) -> None:
        """A pass over the buckets ``order`` (the offloaded step's order) begins: issue the first reads."""
        self.release_all(write=True)  # a checkpoint's materialized state goes back first
        self._order, self._issued = list(order), 0
        self._read_up_to(self.read_ahead)

    def _read_up_to(self, last: int) -> None:
        while self._issued <= min(last, len(self._order) - 1):
            slot = self.slots[self._issued % len(self.slots)]
            self.stats["wait_s"] += slot.wait_free()
            self._read(slot, self._order[self._issued])
            self._issued += 1

    def bring_in(self, i: int) -> None:
        """The i-th bucket of the pass is about to step: its values in a slot, its tensors pointing there."""
        self._read_up_to(i)
        slot = self.slots[i % len(self.slots)]
        assert slot.bucket == self._order[i] and slot.reading, "NVMe swap out of order"
        self.stats["wait_s"] += slot.wait_io()
        self._attach(self._order[i], slot)
        self._read_up_to(i + self.read_ahead)

    def send_out(self, i: int, reader=None) -> None:
        """The i-th bucket stepped: write it back (``reader``: waits until its values were sent elsewhere;
        called before the slot is read into again)."""
        b = self._order[i]
        slot = self.slots[i % len(self.slots)]
        keys = self._collect(b, slot)
        self._detach(b)
        self._write(slot, b, keys)
        slot.reader = reader
        if not self.pipeline_write:
            self.stats["wait_s"] += slot.wait_io()

    def finish(self) -> None:
        """The pass is over: every write on the drive (a checkpoint or the next pass may read it)."""
        for slot in self.slots:
            self.stats["wait_s"] += slot.wait_free()
        self._order, self._issued = [], 0

    # -- all of it at once (checkpoints, edits) ---------------------------------
    def materialize_all(self) -> None:
        """Every bucket's masters and state in fresh host memory, attached, until :meth:`release_all`."""
        self.finish()
        for b in self.buckets:
            if b in self.materialized:
                continue
            slot = self._bulk_slot(b, self._region_count(b))
            self._read(slot, b)
            slot.io.wait()
            slot.reading = False
            self._attach(b, slot)
            self.materialized[b] = slot

    def release_all(self, write: bool) -> None:
        """Give back what :meth:`materialize_all` brought in; ``write``: the values (or state) changed."""
        for b, slot in list(self.materialized.items()):
            if write:
                keys = self._collect(b, slot)
                self._write(slot, b, keys)
                slot.io.wait()
                slot.writing = False
            self._detach(b)
            del self.materialized[b]

    @contextmanager
    def resident(self, b: int, write: bool = True):
        """Bucket b attached for the block (its values edited in it are written back when ``write``)."""
        if b in self.materialized:
            yield
            return
        self.finish()
        slot = self._bulk_slot(b, self._region_count(b))
        self._read(slot, b)
        slot.io.wait()
        slot.reading = False
        self._attach(b, slot)
        try:
            yield
        finally:
            if write:
                self._write(slot, b, self._collect(b, slot))
                slot.io.wait()
            self._detach(b)

    # -- accounting and the end ---------------------------------------------------
    def pool_tensors(self) -> list[torch.Tensor]:
        return [slot.buffer for slot in self.slots]

    def nvme_bytes(self) -> dict[str, int]:
        """What the files hold, by kind: the masters (whole chunks) and the per-element optimizer state."""
        states = sum(where.numel * FLOAT_BYTES * len(keys) for b in self.buckets
                     for where, keys in zip(self.wheres[b], self.piece_keys[b]))
        return {"master_params": sum(self.numels[b] * FLOAT_BYTES for b in self.written), "optimizer_states": states}

    def close(self) -> None:
        """Drop the pool and remove the swap files (engine.destroy()); the state on the drive is gone."""
        for slot in self.slots:
            try:
                slot.wait_free()
            except RuntimeError:
                pass  # an I/O error was reported where it happened; the files go anyway
        self.slots = []
        self.folder.remove()
