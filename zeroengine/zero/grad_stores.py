"""Where gradients live between backward and step: the difference between stages 1 and 2.

Both stores end a boundary with the same thing, this rank's *averaged
gradient chunk* of every bucket (``chunk_grads``); they differ in what a rank
holds on the way:

* :class:`FullGradStore` (stage 1): full gradients, as views into one flat
  buffer that autograd accumulates into; at the end of the accumulation
  boundary's backward, one reduce-scatter per bucket, in place into this
  rank's chunk (nothing is sent between boundaries).
* :class:`PartitionedGradStore` (stage 2): only this rank's gradient chunks.
  As soon as all gradients of a bucket are ready in backward, the bucket is
  reduce-scattered (asynchronously with ``overlap_comm``) and the full
  gradients are freed; chunks accumulate across micro-steps.

Note: bucket launch order. Collectives must be issued in the same order on
every rank, but autograd's ready order can differ between ranks (a parameter
unused on one rank only). Buckets are therefore launched strictly in layout
order: a ready bucket waits for every earlier bucket, and the end of backward
flushes the rest (missing gradients count as zeros).

Note: a gradient accumulated more than once in one backward. Autograd sums all uses of a parameter
in one graph before accumulating, but each segment of reentrant activation checkpointing runs a
backward of its own, so a weight used in several segments (a tied embedding and head, one layer
applied in several checkpointed blocks) is accumulated, and its hook fires, once per segment. A bucket
is complete when each of its parameters has a gradient (distinct parameters are counted, not hook
calls); stage 2 adds each contribution into the bucket's buffer, and one that arrives after its bucket
was sent goes into a new buffer that is reduced at the end of backward (reduction is linear: the sum of
the two reductions is the reduction of the sum). Stage 1 reduces only at the end of backward, when
every contribution is in its flat buffer; since that reduction is in place, a second backward on the
same boundary (``retain_graph``, two losses) is refused there with a clear error.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zeroengine import comm
from zeroengine.buffer_pool import BufferPool

from .flat_params import FlatParamBuffer
from .layout import Bucket, FlatLayout

# Reductions launched but not yet folded into the gradient shard. Each holds a
# bucket buffer (and, on gloo, an all-to-all receive buffer) alive; without a
# bound, all of them would be alive at the end of backward (≈ 10Ψ bytes of
# transient memory in fp32). Two keep one bucket communicating while the next fills.
MAX_BUCKETS_IN_FLIGHT = 2


class BucketReducer:
    """Reduce-scatter of one bucket buffer into this rank's (averaged) chunk, optionally async."""

    def __init__(self, rank: int, world: int, group, comm_dtype: torch.dtype | None, overlap: bool,
                 divisor: int | None = None):
        self.rank, self.world, self.group = rank, world, group
        # The sum is divided by the group size, except for MoE expert gradients: reduced over their
        # expert-data-parallel group but averaged over the whole data-parallel world (zeroengine.zero.moe_split).
        self.divisor = divisor or world
        self.comm_dtype = comm_dtype
        self.overlap = overlap
        self._in_flight: list[tuple[object, torch.Tensor, Bucket, torch.Tensor]] = []

    def launch(self, bucket: Bucket, buffer: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Reduce-scatter ``buffer`` (the bucket) into ``out`` (default: a new chunk-sized tensor)."""
        if self.comm_dtype is not None and buffer.dtype != self.comm_dtype:
            buffer = buffer.to(self.comm_dtype)
            out = None
        if out is None:
            out = torch.empty(bucket.chunk_numel, dtype=buffer.dtype, device=buffer.device)
        work = comm.reduce_scatter(out, buffer, group=self.group, async_op=self.overlap)
        self._in_flight.append((work, out, bucket, buffer))

    def drain(self, keep: int = 0):
        """Wait for the oldest launched buckets until at most ``keep`` are in flight.

        Yields (bucket, averaged chunk, the buffer it was reduced from) for each one finished.
        """
        while len(self._in_flight) > keep:
            work, out, bucket, buffer = self._in_flight.pop(0)
            if work is not None:
                work.wait()
            yield bucket, out.div_(self.divisor), buffer


class _InOrderLauncher:
    """Launches bucket reductions in layout order as their gradients become ready (see module note)."""

    def __init__(self, layout: FlatLayout, launch):
        self.layout = layout
        self._launch = launch
        self.ready: list[set[int]] = [set() for _ in layout.buckets]
        self.next = 0

    def mark_ready(self, bucket_index: int, param_index: int) -> bool:
        """One more parameter of the bucket has its gradient; True when the bucket just became complete
        (a parameter accumulated twice counts once: see "Note: a gradient accumulated more than once")."""
        seen = self.ready[bucket_index]
        if param_index in seen:
            return False
        seen.add(param_index)
        return len(seen) == len(self.layout.buckets[bucket_index].slots)

    def launched(self, bucket_index: int) -> bool:
        return bucket_index < self.next

    def launch_ready(self, force: bool) -> None:
        buckets = self.layout.buckets
        while self.next < len(buckets) and (force or len(self.ready[self.next]) >= len(buckets[self.next].slots)):
            self._launch(buckets[self.next])
            self.next += 1

    def reset(self) -> None:
        self.ready = [set() for _ in self.layout.buckets]
        self.next = 0


class FullGradStore:
    """Stage 1 (see module doc)."""

    def __init__(self, flat_params: FlatParamBuffer, reducer: BucketReducer):
        self.flat_params = flat_params
        self.layout: FlatLayout = flat_params.layout
        self.reducer = reducer
        self.flat_grads = torch.zeros_like(flat_params.flat)
        self.chunk_grads: list[torch.Tensor | None] = [None] * len(self.layout.buckets)
        self._attach_grad_views()
        # Reduced at the end of the boundary micro-step's backward, once every contribution is in (see
        # "Note: a gradient accumulated more than once"); between boundaries nothing is sent.
        self._reduced = False

    def remove_hooks(self) -> None:
        """Nothing to take off: stage 1's gradients land in views of its flat buffer, with no hooks."""

    def cancel_backward(self) -> None:
        """The backward raised: nothing to undo, stage 1 reduces only once the boundary backward is over."""

    def _grad_view(self, slot) -> torch.Tensor:
        p = self.flat_params.params[slot.index]
        return self.flat_grads[slot.flat_start:slot.flat_end].view(p.shape)

    def _attach(self, slot) -> None:
        """Point .grad into flat_grads, keeping what autograd put elsewhere (e.g. after zero_grad(set_to_none))."""
        p = self.flat_params.params[slot.index]
        view = self._grad_view(slot)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def _attach_grad_views(self) -> None:
        for bucket in self.layout.buckets:
            for slot in bucket.slots:
                self._attach(slot)

    def _launch(self, bucket: Bucket) -> None:
        for slot in bucket.slots:
            self._attach(slot)
        lo, hi = bucket.chunk_range(self.reducer.rank)
        # Reduced in place into this rank's own chunk of the flat gradients: no extra memory.
        self.reducer.launch(bucket, self.flat_grads[bucket.flat_start:bucket.flat_start + bucket.padded_numel],
                            out=self.flat_grads[lo:hi])

    def begin_backward(self, is_boundary: bool) -> None:
        if self._reduced:
            raise RuntimeError("ZeRO stage 1: a second backward() on the accumulation-boundary micro-step (two "
                               "losses, or retain_graph) after its gradients were reduced is not supported: "
                               "add the losses and call backward() once, or use stage 0 or 2")

    def finish_backward(self, is_boundary: bool) -> None:
        if not is_boundary:
            return
        for bucket in self.layout.buckets:
            self._launch(bucket)
        for bucket, chunk, _ in self.reducer.drain():
            self.chunk_grads[bucket.index] = chunk.to(self.flat_grads.dtype)
        self._reduced = True

    def zero(self) -> None:
        self.flat_grads.zero_()
        self.chunk_grads = [None] * len(self.layout.buckets)
        self._attach_grad_views()
        self._reduced = False

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.flat_grads] + [c for c in self.chunk_grads if c is not None]

    def comm_buffers(self) -> list[torch.Tensor]:
        return []


# How many engines' backward passes are running now, at any stage (one thread: a GAN's generator backward
# runs through the discriminator's parameters while only the generator's engine is in its backward).
_BACKWARDS_RUNNING = [0]


# Stores that received stray gradients during the running backward: told when it is over.
_STRAY_SEEN: list["PartitionedGradStore"] = []


@contextmanager
def engine_backward():
    """Around an engine's ``loss.backward()`` (Engine.backward)."""
    _BACKWARDS_RUNNING[0] += 1
    try:
        yield
    finally:
        _BACKWARDS_RUNNING[0] -= 1
        if not _BACKWARDS_RUNNING[0]:
            seen, _STRAY_SEEN[:] = list(_STRAY_SEEN), []
            for store in seen:
                store.stray_pass_over()


class PartitionedGradStore:
    """Stage 2 (see module doc).

    Each gradient is copied into its bucket's buffer the moment autograd has
    accumulated it, and the full gradient is dropped at once, so at most the
    buckets between "first gradient arrived" and "reduced" hold full-size
    memory. Bucket buffers are always contiguous, which is what
    ``contiguous_gradients`` asks for; they are freed after their reduction
    rather than pooled, so no full-bucket buffer outlives the backward.
    """

    def __init__(self, flat_params, reducer: BucketReducer, on_bucket_ready=None, on_stray_pass_over=None):
        self.params = flat_params.params
        self.layout: FlatLayout = flat_params.layout
        self.reducer = reducer
        self.dtype = flat_params.dtype
        self.device = flat_params.device
        self.chunk_grads = [torch.zeros(b.chunk_numel, dtype=self.dtype, device=self.device)
                            for b in self.layout.buckets]
        # chunk_grads[b] is all zeros (since zero()): the bucket's first reduction writes into it directly,
        # with no output buffer to add from.
        self._fresh = [True] * len(self.layout.buckets)
        # Bucket buffers and reduction outputs kept for the next micro-step (zeroengine/buffer_pool.py): as many
        # as a steady backward uses at once, the buckets in flight and those filling, a tied weight's bucket
        # and the next.
        self._buffer_pool = BufferPool(keep=MAX_BUCKETS_IN_FLIGHT + 2)
        self._output_pool = BufferPool(keep=MAX_BUCKETS_IN_FLIGHT + 2)
        self.peak_buckets_filling = 0  # most bucket buffers filling at once (full-size gradients held)
        self._bucket_of = self.layout.bucket_of_param()
        self._slot_of = self.layout.slot_of()
        self._buffers: dict[int, torch.Tensor] = {}
        self._launcher = _InOrderLauncher(self.layout, self._launch)
        # Stage 3 frees a bucket's gathered parameters once all its gradients exist.
        self._on_bucket_ready = on_bucket_ready
        # Stage 3 frees everything gathered once another engine's backward through these parameters is over.
        self._on_stray_pass_over = on_stray_pass_over
        self._in_backward = False
        self._has_strays = False  # gradients left in param.grad by another engine's backward
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hooks_last(self) -> None:
        """Move this store's hook behind any post-accumulate-grad hook registered after it (a user's, after
        initialize): it drops ``param.grad`` once the gradient is in its bucket, and theirs must see it first."""
        for p, handle in zip(self.params, self._handles):
            hooks = p._post_accumulate_grad_hooks
            if hooks is not None and len(hooks) > 1 and next(reversed(hooks)) != handle.id:
                # pop and re-insert: autograd walks the underlying dict, whose order move_to_end leaves alone
                hooks[handle.id] = hooks.pop(handle.id)

    def _make_hook(self, index: int):
        def hook(param):
            if not self._in_backward:
                self._outside_backward(index)
                return
            b = self._bucket_of[index]
            bucket = self.layout.buckets[b]
            if param.grad is not None:
                self._move_into_bucket(index, param)
            if self._launcher.launched(b):
                return
            if self._launcher.mark_ready(b, index) and self._on_bucket_ready is not None:
                self._on_bucket_ready(bucket)
            self._launcher.launch_ready(force=False)

        return hook

    def _outside_backward(self, index: int) -> None:
        """A gradient that arrived outside this engine's backward. Inside another engine's backward (a GAN:
        the generator's loss flows through the discriminator) it stays in ``param.grad``, as in torch: this
        engine's next backward takes it (:meth:`_take_leftovers`) unless zero_grad() drops it first, and
        stage 3 frees the parameters once that other backward is over (:meth:`stray_pass_over`). With no
        engine's backward running, it is a plain loss.backward(): refused, since its gradients would be
        reduced unscaled, out of step with the other ranks."""
        if not _BACKWARDS_RUNNING[0]:
            raise RuntimeError(
                "a backward pass reached ZeRO stage 2/3 parameters outside engine.backward(): call "
                "engine.backward(loss) instead of loss.backward() (the engine reduces and scales the "
                "gradients there; this one would be mixed into the next step's)")
        self._has_strays = True
        if self not in _STRAY_SEEN:
            _STRAY_SEEN.append(self)

    def stray_pass_over(self) -> None:
        """The other engine's backward that reached these parameters is over."""
        if self._on_stray_pass_over is not None:
            self._on_stray_pass_over()

    def _take_leftovers(self) -> None:
        """Gradients left in ``param.grad`` by another engine's backward (see :meth:`_outside_backward`) for
        parameters this backward did not reach: into their buckets, as torch would have them in the step."""
        if not self._has_strays:  # (reading .grad of every parameter costs; only strays leave one behind)
            return
        self._has_strays = False
        for index, p in enumerate(self.params):
            if p.grad is not None:
                self._move_into_bucket(index, p)

    def _move_into_bucket(self, index: int, param) -> None:
        """Add ``param.grad`` into its bucket's buffer and drop it (the full gradient is not kept)."""
        bucket = self.layout.buckets[self._bucket_of[index]]
        slot = self._slot_of[index]
        start = slot.flat_start - bucket.flat_start
        # added, not copied: a parameter can be accumulated more than once in one backward, and one whose
        # bucket was already sent starts a new buffer (see the module's notes)
        self._buffer(bucket)[start:start + slot.numel].add_(param.grad.reshape(-1))
        param.grad = None

    def cancel_backward(self) -> None:
        """The backward raised: this engine is no longer in one (its partial buckets go at zero_grad)."""
        self._in_backward = False

    def _buffer(self, bucket: Bucket) -> torch.Tensor:
        buf = self._buffers.get(bucket.index)
        if buf is None:
            buf = self._buffer_pool.take(bucket.padded_numel, self.dtype, self.device, zeroed=True)
            self._buffers[bucket.index] = buf
            self.peak_buckets_filling = max(self.peak_buckets_filling, len(self._buffers))
        return buf

    def _launch(self, bucket: Bucket) -> None:
        self._buffer(bucket)  # a bucket no gradient reached this step (unused on this rank) joins as zeros
        out = None
        if self.reducer.comm_dtype in (None, self.dtype):  # (else the reducer converts, into outputs of its own)
            if self._fresh[bucket.index]:
                out, self._fresh[bucket.index] = self.chunk_grads[bucket.index], False
            else:
                out = self._output_pool.take(bucket.chunk_numel, self.dtype, self.device)
        self.reducer.launch(bucket, self._buffers.pop(bucket.index), out=out)
        # Bound the memory of reductions: one bucket on the wire while the next one fills.
        self._accumulate(keep=MAX_BUCKETS_IN_FLIGHT)

    def begin_backward(self, is_boundary: bool) -> None:
        self._launcher.reset()
        self._hooks_last()
        self._in_backward = True

    def _accumulate(self, keep: int) -> None:
        for bucket, chunk, buffer in self.reducer.drain(keep):
            target = self.chunk_grads[bucket.index]
            if chunk is not target:  # (a first reduction wrote into the chunk itself)
                target.add_(chunk)
                self._output_pool.give(chunk)
            self._buffer_pool.give(buffer)

    def finish_backward(self, is_boundary: bool) -> None:
        # Stage 2 reduces every micro-step: keeping full gradients until the
        # boundary would defeat its memory saving.
        self._in_backward = False
        self._take_leftovers()
        self._launcher.launch_ready(force=True)
        self._reduce_late()
        self._accumulate(keep=0)
        self._launcher.reset()

    def _reduce_late(self) -> None:
        """Reduce what reached buckets after they were sent (left in ``_buffers``; see "Note: a gradient
        accumulated more than once"). The ranks agree on which buckets first (a tiny control all-gather),
        since the reductions must pair: a rank whose bucket was sent later may have no such leftover."""
        buckets = self.layout.buckets
        if self.reducer.world > 1:
            # On the group's host twin: an exchange on the device would wait for all its queued work.
            host = comm.host_group(self.reducer.group)
            device = comm.device_for_backend() if host is None else torch.device("cpu")
            mine = torch.zeros(len(buckets), dtype=torch.int32, device=device)
            if self._buffers:
                mine[sorted(self._buffers)] = 1
            everyone = torch.empty(len(buckets) * self.reducer.world, dtype=torch.int32, device=device)
            comm.control_all_gather(everyone, mine, group=self.reducer.group if host is None else host)
            late = everyone.view(self.reducer.world, -1).amax(0).nonzero().flatten().tolist()
        else:
            late = sorted(self._buffers)
        for index in late:
            self._buffer(buckets[index])  # zeros on a rank that had nothing left for this bucket
            self.reducer.launch(buckets[index], self._buffers.pop(index))

    def zero(self) -> None:
        # A backward that failed part-way (an error in the loss's graph) may have left buckets filled or on
        # the wire: finish those reductions (every rank launched them) and drop them with the rest.
        for _bucket, chunk, buffer in self.reducer.drain(0):
            if not any(chunk is c for c in self.chunk_grads):
                self._output_pool.give(chunk)
            self._buffer_pool.give(buffer)
        for buf in self._buffers.values():
            self._buffer_pool.give(buf)
        self._buffers.clear()
        self._launcher.reset()
        self._in_backward = False
        self._has_strays = False
        for c in self.chunk_grads:
            c.zero_()
        self._fresh = [True] * len(self.chunk_grads)
        for p in self.params:
            p.grad = None

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.chunk_grads)

    def comm_buffers(self) -> list[torch.Tensor]:
        return list(self._buffers.values()) + self._buffer_pool.tensors() + self._output_pool.tensors()
