"""Stage 3's parameters: each rank stores only its chunks; full tensors exist while a module needs them.

A bucket is in one of three states:

* *sharded*: its parameters' ``.data`` is an empty placeholder and they carry
  the partitioned-parameter marker (:mod:`zeroengine.zero.param_guard`);
* *in flight*: an asynchronous all-gather (a prefetch) is filling its full
  buffer; the parameters are pointed at it once the gather is waited for;
* *gathered*: the parameters are views of the full buffer.

``fetch_async(bucket)`` starts sharded -> in flight, ``gather(bucket)`` ends
in gathered (waiting for a prefetch, or gathering on demand), and
``release(bucket)`` frees the buffer. *Persistent* buckets (parameters below
``stage3_param_persistence_threshold``) are gathered once and never released:
every rank keeps them whole, and only their optimizer state and gradients are
partitioned. Autograd keeps working across release/gather because a saved
leaf parameter is read through the Parameter object, whose ``.data`` is
gathered again before the module's backward runs (see
:mod:`zeroengine.zero.stage3_hooks`), and saved views through the storage
(see the note below).

Note: one storage per bucket.
Autograd saves *views* of gathered parameters, not only the parameters: on
CPU ``F.linear`` saves ``weight.t()``, and user code like ``x @ w.t()`` does
the same. Pointing a released parameter at a new buffer for backward would
leave those views on the old buffer, alive (so nothing is freed) and stale if
it were ever reused. So each bucket keeps one full-size tensor for the
buffer's lifetime (as torch FSDP2 does): release resizes its storage to 0
bytes (the memory is freed, views become empty), and the next gather resizes
it back and all-gathers into the same storage, so every view saved in forward
sees the values again in backward. With ``ZEROENGINE_MALLOC_MMAP_THRESHOLD``
set, on CPU the storage keeps its memory and a release hands its pages back
to the OS instead (see :mod:`zeroengine.zero.host_memory`).

Note: reusing memory.
On CPU a resize to 0 bytes hands the memory to glibc, which keeps freed
blocks in its heap and fragments it; the next gather then allocates afresh.
Where torch can move memory between storages (``_swap_data_ptr_``, torch
2.13), a release instead moves the bucket's memory into a spare kept here, and
the next gather of a bucket of that size moves a spare under its own storage:
views autograd saved still see their bucket's storage object, and after the
first step nothing goes through malloc. Gathered plus spare memory stays
within the most ever gathered at once (what ``stage3_max_live_parameters``
bounds): a gather that finds no spare of its size frees spares of other sizes
first. Accelerators keep the resize: their caching allocator pools.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from zeroengine import comm
from zeroengine.offload.nvme import param_swapper

from . import host_memory
from .flat_params import ParamBuffer, copy_into, gather_chunk
from .layout import Bucket, FlatLayout
from .param_guard import full_shape, mark_gathered, mark_partitioned


@dataclass
class FetchStats:
    """What the gathers of one buffer cost, for tests and benchmarks (elements, not bytes)."""

    on_demand: int = 0  # gathers issued at the moment of need: the caller waits for the whole collective
    prefetched: int = 0  # asynchronous gathers issued ahead of need
    waited_in_flight: int = 0  # needs that found their prefetch still running (timing-dependent)
    gathered_numel: int = 0  # elements received by all gathers
    live_numel: int = 0  # elements of non-persistent buckets gathered or in flight now
    peak_live_numel: int = 0
    labels: list = field(default_factory=list)  # (label, on_demand?) per gather, when recording is on
    record_labels: bool = False

    def reset(self) -> None:
        live = self.live_numel
        self.__init__(record_labels=self.record_labels)
        self.live_numel = self.peak_live_numel = live


class PartitionedParamBuffer(ParamBuffer):
    partitioned = True
    order_check = None  # a GatherOrderCheck shared by the model's buffers, set once they all exist
    order_tag = 0  # this buffer's number in the check (its position among the stage's buffers)

    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, dtype: torch.dtype, rank: int,
                 group=None, names: list[str] | None = None, persistent: frozenset[int] = frozenset(),
                 chunk_source=None, stats: FetchStats | None = None, offload=None, in_cpu_budget=None):
        """``chunk_source(bucket)`` returns this rank's chunk of a bucket (default: read from the full
        parameters); ``persistent`` names buckets that stay gathered; ``offload`` (the ``offload_param``
        config) keeps the shard in CPU memory, pinned when an accelerator copies from it, or on NVMe
        (``in_cpu_budget``: what is left of its max_in_cpu, shared by the stage's buffers)."""
        super().__init__(params, layout, dtype, rank, group)
        self.shapes = [full_shape(p) for p in params]
        self.names = names or [f"param{i}" for i in range(len(params))]
        self.persistent = persistent
        self.stats = stats if stats is not None else FetchStats()  # one object may serve several buffers
        # offload_param: between uses a parameter exists only as this rank's chunk in CPU memory; a gather
        # copies the chunk up to the compute device first, and the optimizer's update lands here directly.
        # device "nvme": chunks beyond max_in_cpu live in a swap file instead (zeroengine/offload/nvme/param_swap.py)
        pin = offload is not None and bool(offload.pin_memory) and torch.cuda.is_available()
        self.swap = None
        if offload is not None and offload.device == "nvme":
            self.swap = param_swapper(offload, [b.chunk_numel for b in layout.buckets], dtype, pin, in_cpu_budget)
        self._chunk_start: dict[int, int] = {}  # bucket -> its chunk's offset in the shard (those in memory)
        offset = 0
        for bucket in layout.buckets:
            if not self.on_drive(bucket):
                self._chunk_start[bucket.index] = offset
                offset += bucket.chunk_numel
        self.shard = torch.zeros(offset, dtype=dtype, device="cpu" if offload is not None else self.device,
                                 pin_memory=pin)
        with torch.no_grad():
            for bucket in layout.buckets:  # one chunk at a time: with NVMe, written before the next is made
                chunk = chunk_source(bucket) if chunk_source is not None else gather_chunk(params, bucket, rank,
                                                                                           dtype)
                self.store_chunk(bucket, chunk)
        self.full: list[torch.Tensor | None] = [None] * len(layout.buckets)  # set while gathered / in flight
        # One full-size tensor per bucket for the buffer's lifetime; a release takes its memory away and
        # the next gather gives it memory again (see "Note: one storage per bucket" and "reusing memory").
        self._storage: list[torch.Tensor | None] = [None] * len(layout.buckets)
        # Buckets whose memory a tensor outside the buffer still views (see leave_memory_to_views).
        self._viewed: set[int] = set()
        # Buckets a GatheredParameters block holds: a forward inside it must not release them under the user.
        self._pinned: dict[int, int] = {}
        self._pending: list[object | None] = [None] * len(layout.buckets)
        self._empty = torch.empty(0, dtype=dtype, device=self.device)
        self._release_pages = host_memory.return_freed_memory() and host_memory.can_drop_pages(self._empty)
        # CPU: released memory is kept for the next gather of the same size (see "Note: reusing memory")
        self._spares = _Spares() if self.device.type == "cpu" and _Spares.supported() else None
        for bucket in layout.buckets:
            self._point_at_nothing(bucket)
        for bucket in layout.buckets:
            if bucket.index in persistent:
                self.gather(bucket, label="persistent parameters")

    def chunk_view(self, bucket: Bucket, rank: int) -> torch.Tensor:
        if rank != self.rank:
            raise ValueError(f"rank {self.rank} holds only its own chunks, not rank {rank}'s")
        if self.on_drive(bucket):
            raise RuntimeError(f"bucket {bucket.index}'s chunk is on NVMe (offload_param): use read_chunk / "
                               "store_chunk")
        start = self._chunk_start[bucket.index]
        return self.shard[start:start + bucket.chunk_numel]

    def on_drive(self, bucket: Bucket) -> bool:
        """Whether the bucket's chunk lives in the NVMe swap file rather than in host memory."""
        return self.swap is not None and self.swap.on_drive(bucket.index)

    def read_chunk(self, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk: the shard's view where it is in memory, else a new tensor read from the drive."""
        if self.on_drive(bucket):
            return self.swap.read_new(bucket.index)
        return self.chunk_view(bucket, self.rank)

    def store_chunk(self, bucket: Bucket, values: torch.Tensor, start: int = 0, wait: bool = True):
        """Write ``values`` into this rank's chunk from element ``start``. ``wait=False``: returns a callable
        that waits until ``values`` has been read (or None), for a caller that reuses that buffer soon."""
        with torch.no_grad():
            if not self.on_drive(bucket):
                view = self.chunk_view(bucket, self.rank)[start:start + values.numel()]
                if view.data_ptr() == values.data_ptr():
                    return None
                copied = copy_into(view, values)
                done = None if copied is None else copied.synchronize
            elif start == 0 and values.numel() == bucket.chunk_numel:
                done = self.swap.write(bucket.index, values)
            else:  # part of a chunk: read, change, write back
                chunk = self.swap.read_new(bucket.index)
                chunk[start:start + values.numel()].copy_(values)
                done = self.swap.write(bucket.index, chunk)
        if wait and done is not None:
            done()
            return None
        return done

    def close_swap(self) -> None:
        """engine.destroy(): remove the NVMe swap file (the values in it are gone)."""
        if self.swap is not None:
            self.swap.close()
    def is_gathered(self, bucket: Bucket) -> bool:
        return self.full[bucket.index] is not None and self._pending[bucket.index] is None

    def is_fetched(self, bucket: Bucket) -> bool:
        """Gathered or in flight."""
        return self.full[bucket.index] is not None

    # -- gather / release -------------------------------------------------------
    def _launch(self, bucket: Bucket, label: str, async_op: bool):
        if self.order_check is not None:  # every rank gathers this bucket now, or all raise (see gather_order)
            self.order_check.verify(self.order_tag, bucket, label)
        full = self.full[bucket.index] = self._with_memory(bucket)
        if bucket.index not in self.persistent:
            self.stats.live_numel += bucket.padded_numel
            self.stats.peak_live_numel = max(self.stats.peak_live_numel, self.stats.live_numel)
        self.stats.gathered_numel += bucket.padded_numel
        if self.stats.record_labels:
            self.stats.labels.append((label, not async_op))
        # The label goes into the collective's fingerprint (comm_debug): a rank that skipped a module
        # shows up as "rank 0 gathered for module A, rank 1 for module B".
        ctx = comm.collective_context(label) if label else nullcontext()
        if self.on_drive(bucket):  # read into a pool buffer, lent until the collective has read it
            own = self._read_for_gather(bucket, full.device)
        else:
            own = self.chunk_view(bucket, self.rank)
        if own.device != full.device:  # offloaded shard: up first (the collective keeps the copy alive)
            own = own.to(full.device, non_blocking=own.is_pinned())
        # The gather rewrites a tensor autograd may have saved views of: same values, so the version
        # bump an in-place write makes would only raise a false "modified in place" error. A failed or
        # timed-out collective raises comm's CollectiveError, which names the module (the label) and,
        # for a peer's fault, suggests comm_debug; a local error (say, out of memory staging an offloaded
        # shard) stays what it is.
        with ctx, torch.autograd._unsafe_preserve_version_counter(full):
            work = comm.all_gather(full, own, group=self.group, async_op=async_op)
        if not async_op:
            self._source_read(bucket)
        return work

    def _read_for_gather(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        buffer = self.swap.take_buffer(self._finish_gather)
        own = self.swap.read(bucket.index, buffer)
        if device.type == "cpu":
            self.swap.lend(bucket.index, buffer)
            return own
        own = own.to(device)  # synchronous: the buffer is free again at once
        self.swap.put_back(buffer)
        return own

    def _finish_gather(self, index: int) -> None:
        """Every NVMe read buffer is lent: wait for the oldest gather using one (it keeps its result)."""
        work = self._pending[index]
        if work is not None:
            work.wait()
            self._pending[index] = _DONE
        self._source_read(self.layout.buckets[index])

    def _source_read(self, bucket: Bucket) -> None:
        """The bucket's gather has read its source: an NVMe read buffer goes back to the pool."""
        if self.swap is not None:
            self.swap.give_back(bucket.index)

    def fetch_async(self, bucket: Bucket, label: str = "") -> None:
        """Start gathering ``bucket`` (a prefetch); :meth:`gather` completes it."""
        if self.full[bucket.index] is not None:
            return
        self._pending[bucket.index] = self._launch(bucket, label, async_op=True) or _DONE
        self.stats.prefetched += 1

    def gather(self, bucket: Bucket, label: str = "") -> None:
        """Make ``bucket``'s parameters hold their full values (waiting for its prefetch, if any)."""
        work = self._pending[bucket.index]
        if work is not None:
            if not work.is_completed():
                self.stats.waited_in_flight += 1
            work.wait()  # a CollectiveError names this collective and its module
            self._pending[bucket.index] = None
            self._source_read(bucket)
        elif self.full[bucket.index] is None:
            self.stats.on_demand += 1
            self._launch(bucket, label, async_op=False)
        else:
            return
        self._point_at_full(bucket)

    def pin(self, bucket: Bucket) -> None:
        """Keep ``bucket`` gathered until :meth:`unpin` (the module hooks' releases pass it by)."""
        self._pinned[bucket.index] = self._pinned.get(bucket.index, 0) + 1

    def unpin(self, bucket: Bucket) -> None:
        left = self._pinned[bucket.index] - 1
        if left:
            self._pinned[bucket.index] = left
        else:
            del self._pinned[bucket.index]

    def release(self, bucket: Bucket, force: bool = False) -> None:
        if self.full[bucket.index] is None or (bucket.index in self.persistent and not force):
            return
        if bucket.index in self._pinned and not force:
            return
        if self._pending[bucket.index] is not None:  # its buffer is being written: finish first
            self._pending[bucket.index].wait()
            self._pending[bucket.index] = None
            self._source_read(bucket)
        self.full[bucket.index] = None
        self._without_memory(bucket)
        if bucket.index not in self.persistent:
            self.stats.live_numel -= bucket.padded_numel
        self._point_at_nothing(bucket)

    def _with_memory(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's full-size tensor, with memory behind it (see the module's notes)."""
        numel = bucket.padded_numel
        full = self._storage[bucket.index]
        spare = None
        if self._spares is not None:
            spare = self._spares.take(numel, self.stats.live_numel, self.stats.peak_live_numel)
        if full is None:
            full = self._storage[bucket.index] = spare if spare is not None else torch.empty(
                numel, dtype=self.dtype, device=self.device)
        elif full.untyped_storage().nbytes() == 0:
            if spare is not None:  # move the spare memory under this bucket's own storage
                full.untyped_storage()._swap_data_ptr_(spare.untyped_storage())
            else:
                full.untyped_storage().resize_(numel * full.element_size())
        return full

    def shares_memory_with(self, bucket: Bucket, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views this bucket's gathered memory."""
        storage = self._storage[bucket.index]
        return (storage is not None and self.full[bucket.index] is not None
                and tensor.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr())

    def leave_memory_to_views(self, bucket: Bucket) -> None:
        """A module returned a view of its parameter (``self.table[:n]``): its caller reads it after the
        module's post-forward release. Freeing, dropping or reusing that memory would leave the view on
        freed memory (a segfault) or other values, so the next release gives the memory up to the views
        (they keep it alive while they live) and the bucket's next gather gets new memory."""
        self._viewed.add(bucket.index)

    def _without_memory(self, bucket: Bucket) -> None:
        if bucket.index in self._viewed:
            self._viewed.discard(bucket.index)
            self._storage[bucket.index] = None
            return
        storage = self._storage[bucket.index]
        if self._release_pages:
            host_memory.drop_pages(storage)
        elif self._spares is not None:  # keep the memory for the next gather of this size
            self._spares.keep(storage)
        else:
            storage.untyped_storage().resize_(0)

    def _slot_view(self, bucket: Bucket, slot) -> torch.Tensor:
        start = slot.flat_start - bucket.flat_start
        return self.full[bucket.index][start:start + slot.numel].view(self.shapes[slot.index])

    def _point_at_full(self, bucket: Bucket) -> None:
        for slot in bucket.slots:
            p = self.params[slot.index]
            with torch._C.DisableTorchFunctionSubclass():  # the guard refuses .data = ... from user code
                p.data = self._slot_view(bucket, slot)
            mark_gathered(p)

    def _point_at_nothing(self, bucket: Bucket) -> None:
        for slot in bucket.slots:
            p = self.params[slot.index]
            with torch._C.DisableTorchFunctionSubclass():
                p.data = self._empty
            mark_partitioned(p, self.names[slot.index], self.shapes[slot.index])

    def take_replaced_data(self, bucket: Bucket, keep_values: bool) -> None:
        """After user code ran on the gathered bucket (GatheredParameters): a parameter whose ``.data`` was
        replaced (``p.data = t``) no longer views the bucket, so the edit would be lost. With ``keep_values``
        (the modifier rank) its new values are copied into the bucket; on every rank it views the bucket
        again."""
        if self.full[bucket.index] is None:
            return
        for slot in bucket.slots:
            p = self.params[slot.index]
            view = self._slot_view(bucket, slot)
            if p.data_ptr() == view.data_ptr() and p.shape == view.shape:
                continue
            if keep_values:
                if p.shape != view.shape:
                    raise ValueError(f"GatheredParameters: {self.names[slot.index]}.data was replaced by a tensor of "
                                     f"shape {tuple(p.shape)}; a partitioned parameter keeps its shape "
                                     f"{tuple(view.shape)}")
                with torch.no_grad():
                    view.copy_(p.detach())
            with torch._C.DisableTorchFunctionSubclass():
                p.data = view

    # -- after the optimizer step ------------------------------------------------
    def write_chunk(self, bucket: Bucket, values: torch.Tensor):
        """Take one bucket's updated values into this rank's shard now (an offloaded step sends each bucket
        as it is done); returns a callable that waits until ``values`` has been read."""
        return self.store_chunk(bucket, values, wait=False)

    def after_step(self, chunks: list[torch.Tensor | None]) -> None:
        """Take the optimizer's updated chunks (None: already written, see :meth:`write_chunk`); re-gather
        every bucket that is gathered right now."""
        for bucket, chunk in zip(self.layout.buckets, chunks):
            if chunk is not None:
                self.store_chunk(bucket, chunk, wait=False)
        if self.swap is not None:
            self.swap.wait_writes()  # (the refresh below reads them again)
        refresh = [b for b in self.layout.buckets if self.full[b.index] is not None]
        for bucket in refresh:
            self.release(bucket, force=True)
        # Every rank holds the same buckets gathered here (persistent ones, and those of a GatheredParameters
        # block every rank entered, which was checked): their refresh needs no order check of its own.
        with self.order_check.covered() if self.order_check is not None else nullcontext():
            for bucket in refresh:
                self.fetch_async(bucket, label="parameters refreshed after the step")
        for bucket in refresh:
            self.gather(bucket)

    def set_param_value(self, slot, bucket: Bucket, flat_value: torch.Tensor) -> None:
        """Keep this rank's slice of a new full value (and the gathered copy, if any)."""
        own = bucket.piece(slot, self.rank)
        if own is not None:
            self.store_chunk(bucket, flat_value[own.param_start:own.param_end], start=own.chunk_start)
        full = self.full[bucket.index]
        if full is not None:
            self.gather(bucket)
            start = slot.flat_start - bucket.flat_start
            full[start:start + slot.numel].copy_(flat_value)

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.shard] + [f for f in self.full if f is not None]

    def spare_tensors(self) -> list[torch.Tensor]:
        """Idle memory kept for the next gathers (within the most ever gathered at once)."""
        spares = [] if self._spares is None else self._spares.tensors()
        return spares + (self.swap.pool_tensors() if self.swap is not None else [])


class _Spares:
    """Memory released CPU buckets left behind, by padded size, for the next gathers ("Note: reusing memory")."""

    def __init__(self):
        self._by_size: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def supported() -> bool:
        return hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # torch >= 2.13

    def keep(self, full: torch.Tensor) -> None:
        """Move ``full``'s memory into a new spare; ``full``'s storage is left with 0 bytes."""
        spare = torch.empty(0, dtype=full.dtype, device=full.device)
        full.untyped_storage()._swap_data_ptr_(spare.untyped_storage())
        self._by_size.setdefault(full.numel(), []).append(spare.set_(spare.untyped_storage(), 0, full.shape))

    def take(self, numel: int, live_numel: int, peak_numel: int) -> torch.Tensor | None:
        """A spare of ``numel`` elements, or None; in that case ``numel`` is about to be allocated afresh, so
        spares of other sizes are freed until gathered (``live_numel``) plus spare memory stays within the
        most ever gathered at once (``peak_numel``): spares of one size cannot serve another."""
        spares = self._by_size.get(numel)
        if spares:
            return spares.pop()
        held = live_numel + numel + sum(t.numel() for t in self.tensors())
        bound = max(peak_numel, live_numel + numel)
        for size in sorted(self._by_size, reverse=True):
            while held > bound and self._by_size[size]:
                self._by_size[size].pop()
                held -= size
        self._by_size = {size: kept for size, kept in self._by_size.items() if kept}
        return None

    def tensors(self) -> list[torch.Tensor]:
        return [t for kept in self._by_size.values() for t in kept]


class _Done:
    """The handle of a collective that already completed (a synchronous fallback)."""

    @staticmethod
    def wait(timeout=None):
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


_DONE = _Done()
