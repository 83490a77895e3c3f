"""Stages 1 and 2: each rank steps only its shard of the optimizer state (and master weights).

The optimizer never sees a model parameter. It steps *pieces*: for every
bucket, this rank's chunk split at parameter boundaries, each piece put in
the torch param group its parameter belonged to (so per-group lr and weight
decay hold). In fp32 training a piece is a view into the flat parameter
buffer, so stepping it updates the model in place (no master copy: docs/concepts.md's
K = 8); in 16-bit training it is a view into an fp32 master chunk. After the
step, each bucket's updated chunks are all-gathered into every rank's
parameters. Stage 1 and stage 2 differ only in their gradient store
(:mod:`zeroengine.zero.grad_stores`).

With ``offload_optimizer``, the *offloaded* buckets (all of them, or the
share ``ratio`` asks for: :mod:`zeroengine.offload.placement`) keep their
fp32 masters and optimizer state in CPU memory and step there, streamed
bucket by bucket (:mod:`zeroengine.offload.step`); the other, *resident*
buckets step beside the parameters first, so an accelerator's step runs
while the CPU steps. Resident gradients are unscaled where they are; offloaded
ones are unscaled (and clipped) on the host. With ``delayed_update`` the
offloaded buckets step in a background thread during the next step's
forward and backward (:mod:`zeroengine.offload.delayed`); their result is
written into the model at the start of the next step (:meth:`land_delayed_update`).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from zeroengine import comm
from zeroengine.config import ConfigError
from zeroengine.memory import MemoryTally
from zeroengine.offload import DelayedUpdate, OffloadedStep, place_buckets
from zeroengine.offload.nvme import optimizer_swapper
from zeroengine.optim.partitioned import PartitionAware, stepping

from .flat_params import gather_chunk
from .layout import FlatLayout
from .optimizer import StatePiece, ZeroOptimizer, finite_sqrt


class ShardedOptimizer(ZeroOptimizer):
    def __init__(self, module, optimizer, policy, loss_scaler, gradient_clipping: float, flat_params,
                 fp32_values: list[torch.Tensor] | None, grad_store, rank: int, group=None, after_backward=None,
                 offload=None):
        super().__init__(optimizer, policy, loss_scaler, gradient_clipping)
        self.module = module
        self.flat_params = flat_params
        self.layout: FlatLayout = flat_params.layout
        self.grad_store = grad_store
        self.rank = rank
        self.group = group
        buckets = self.layout.buckets
        # offload_optimizer: the offloaded buckets' fp32 masters (and so the optimizer state, created
        # beside them) live in CPU memory, pinned when an accelerator copies to and from them.
        self.offload = offload
        self.placement = None if offload is None else place_buckets([b.chunk_numel for b in buckets],
                                                                   float(offload.ratio))
        host = sorted(self.placement.host_buckets) if self.placement is not None else []
        self.chunks: list[torch.Tensor] = []
        self.pieces: list[list[torch.nn.Parameter]] = []
        # device "nvme": the offloaded buckets' masters and optimizer state live in swap files, each bucket
        # written as soon as its masters are made (zeroengine/offload/nvme/optimizer_swap.py).
        self.swapper = None
        if host and offload.device == "nvme" and isinstance(optimizer, PartitionAware):
            raise ConfigError("zero_optimization.offload_optimizer.device",
                              f"{type(optimizer).__name__} keeps per-matrix statistics, which the NVMe swap (one "
                              "value per element in each state file) does not hold yet: use device \"cpu\"")
        if host and offload.device == "nvme":
            self.swapper = optimizer_swapper(offload, optimizer, self.chunks, self.pieces, self.layout, rank, host,
                                             pin=bool(offload.pin_memory) and torch.cuda.is_available())
        for bucket in buckets:
            self.chunks.append(self._stepped_chunk(bucket, fp32_values))
            self.pieces.append(self._pieces_of(bucket.index))
            if self.swapper is not None and self.on_host(bucket.index):
                self.swapper.store_initial(bucket.index)
        # Offload: the step streams gradients down bucket by bucket (zeroengine/offload/step.py). In 16-bit
        # training with fp32 masters the C++ CPU Adam writes each updated value out in the model's dtype in the
        # same pass (into pinned staging buffers), so the copy back needs no conversion; bf16 masters are that
        # dtype already and go back as they are.
        copy_dtype = policy.param_dtype if policy.separate_masters and hasattr(optimizer, "step_with_copy") else None
        self.offloaded_step = None if not host else OffloadedStep(
            optimizer, self.layout, rank, self.chunks, self.pieces, copy_dtype, bool(offload.pin_memory),
            buckets=host, swapper=self.swapper, grad_dtype=policy.master_dtype)
        if host and offload.delayed_update and isinstance(optimizer, PartitionAware):
            raise ConfigError("zero_optimization.offload_optimizer.delayed_update",
                              f"{type(optimizer).__name__} reduces statistics across ranks inside its step, which "
                              "the delayed update runs in a background thread: turn delayed_update off")
        self.delayed = None if not host or not offload.delayed_update else DelayedUpdate(
            optimizer, self.layout, rank, self.pieces, host, bool(offload.pin_memory),
            offload.delayed_update_warmup_steps, grad_dtype=policy.master_dtype)
        self.resident_buckets = [b.index for b in buckets if not self.on_host(b.index)]
        self._inv_scale, self._clip_coef = 1.0, 1.0
        self._refreshing: list = []  # all-gathers of updated buckets started by the offloaded step
        self._fp32_chunk_grads: list[torch.Tensor] = []  # resident buckets' unscaled fp32 gradients
        self._host_grads: list[torch.Tensor] = []  # offloaded buckets' gradients, still loss-scaled
        self._after_backward = after_backward

    def on_host(self, bucket_index: int) -> bool:
        """True when the bucket's masters and optimizer state are offloaded to CPU memory."""
        return self.placement is not None and self.placement.on_host(bucket_index)

    def _stepped_chunk(self, bucket, fp32_values) -> torch.Tensor:
        """This rank's chunk of ``bucket`` as the optimizer steps it, where it steps: a new fp32 master (16-bit
        training), a copy in host memory (an offloaded bucket: fp32, or bf16 with bf16 masters) or a view of the
        parameters. One bucket at a time, so no more than a bucket's masters ever exist twice or on the wrong
        side."""
        if self.policy.separate_masters:
            chunk = gather_chunk(fp32_values, bucket, self.rank, torch.float32)
        else:  # (a copy where the parameters' chunk is on NVMe: the step's result is written back to it)
            chunk = self.flat_params.read_chunk(bucket)
        if self.on_host(bucket.index):
            return self._to_host(chunk, fresh=self.policy.separate_masters or self._on_drive(bucket))
        if chunk.device != self.flat_params.device:  # masters cut from values zero.Init kept in CPU memory
            return chunk.to(self.flat_params.device)
        return chunk

    def _to_host(self, chunk: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """``chunk`` in CPU memory (pinned when asked); ``fresh``: the chunk is nobody else's, keep it if it
        is already what is needed."""
        pin = bool(self.offload.pin_memory) and torch.cuda.is_available()
        if fresh and chunk.device.type == "cpu" and (chunk.is_pinned() or not pin):
            return chunk
        return self._host_buffer(chunk.shape, chunk.dtype).copy_(chunk)

    def _host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu",
                           pin_memory=bool(self.offload.pin_memory) and torch.cuda.is_available())

    def _pieces_of(self, bucket_index: int) -> list[torch.nn.Parameter]:
        chunk = self.chunks[bucket_index]
        return [torch.nn.Parameter(chunk[p.chunk_start:p.chunk_start + p.numel])
                for p in self.layout.buckets[bucket_index].pieces_in_chunk(self.rank)]

    def adopt_param_groups(self, group_of_param: list[int]) -> None:
        """Replace the torch optimizer's parameters by this rank's pieces, group by group."""
        if self.optimizer.state:
            raise ValueError("ZeRO needs a fresh optimizer: the one passed in has already stepped")
        new_params: list[list[torch.nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        for bucket, pieces in zip(self.layout.buckets, self.pieces):
            for where, piece in zip(bucket.pieces_in_chunk(self.rank), pieces):
                new_params[group_of_param[where.slot.index]].append(piece)
        for group, params in zip(self.optimizer.param_groups, new_params):
            group["params"] = params

    # -- ZeroOptimizer pieces ---------------------------------------------------
    def begin_backward(self, is_boundary: bool) -> None:
        self.flat_params.check_attached()
        self.grad_store.begin_backward(is_boundary)

    def cancel_backward(self) -> None:
        self.grad_store.cancel_backward()
        if self._after_backward is not None:  # stage 3: free what the failed pass had gathered
            self._after_backward(False)

    def finish_backward(self, is_boundary: bool) -> None:
        self.grad_store.finish_backward(is_boundary)
        if self._after_backward is not None:  # stage 3: free, and compare the pass across ranks
            self._after_backward(True)

    # -- the delayed update (offload_optimizer.delayed_update) ------------------
    def wait_delayed_update(self) -> None:
        """Let the background optimizer step finish (local): the masters and optimizer state are then final."""
        if self.delayed is not None:
            self.delayed.wait()

    def wait_if_creating_state(self) -> None:
        """Wait only if the background step may be adding optimizer state (its first step): reading the state's
        sizes is safe otherwise, and a monitor's memory row then leaves the overlap alone."""
        if self.delayed is not None and self.delayed.creating_state:
            self.delayed.join()  # sizes only: a failure is for the landing to raise, on every rank at once

    def discard_delayed_update(self) -> None:
        if self.delayed is not None:
            self.delayed.discard()

    def land_delayed_update(self) -> None:
        """Write the last delayed update into the model's parameters (collective at stages 1-2: an
        all-gather). Called where every rank is: the next step's start, saving, a modifying GatheredParameters."""
        if self.delayed is None:
            return
        # The ranks first agree that every background step succeeded: those of the landing's all-gather, or the
        # world under model parallelism (as for the norm), the ranks that would otherwise wait on a failed one.
        landed = set(self.delayed.take_landing(None if self.model_parallel else self.group))
        if landed:
            self.flat_params.after_step([self.chunks[b] if b in landed else None for b in range(len(self.chunks))])

    def _in_flight(self, bucket_index: int) -> bool:
        """Whether a background step may be writing this bucket's masters (or has, unseen by the model)."""
        return self.delayed is not None and self.delayed.pending and self.on_host(bucket_index)

    def load_chunk_from_params(self, bucket_index: int) -> None:
        """Stage 3: a parameter was edited in place (GatheredParameters); make the master chunk follow."""
        self.wait_delayed_update()
        bucket = self.layout.buckets[bucket_index]
        src = self.flat_params.read_chunk(bucket)
        with self._resident(bucket_index):
            if self.chunks[bucket_index].data_ptr() != src.data_ptr():
                self.chunks[bucket_index].copy_(src)

    def _on_drive(self, bucket) -> bool:
        """Whether stage 3 keeps the bucket's parameter chunk on NVMe (offload_param device "nvme")."""
        return self.flat_params.on_drive(bucket)

    def _resident(self, bucket_index: int):
        """The bucket's masters (and state) in host memory for the block: a no-op unless they are on NVMe."""
        if self.swapper is None or not self.on_host(bucket_index):
            return nullcontext()
        return self.swapper.resident(bucket_index)

    def _unscaled_fp32_grads(self, inv_scale: float) -> list[torch.Tensor]:
        """Resident buckets' gradients unscaled in fp32 (set as their pieces' .grad), then the offloaded
        buckets' gradients as they are: those stay where they were reduced, loss-scaled, until the
        offloaded step copies them down and unscales them on the host."""
        self.land_delayed_update()  # the last step's delayed update, before this step's gradients are read
        self._inv_scale, self._clip_coef = inv_scale, 1.0
        self._host_grads = [self.grad_store.chunk_grads[b] for b in range(len(self.layout.buckets))
                            if self.on_host(b) and self.grad_store.chunk_grads[b] is not None]
        grads = []
        for bucket, chunk_grad, pieces in zip(self.layout.buckets, self.grad_store.chunk_grads, self.pieces):
            if self.on_host(bucket.index):
                continue
            if chunk_grad is None:  # never happens after a backward; zeros keep a bare step() well-defined
                chunk_grad = torch.zeros(bucket.chunk_numel, device=self.chunks[bucket.index].device)
            # (fp32: the masters' dtype; bf16_master_weights_and_grads steps bf16 parameters with bf16 gradients)
            g = chunk_grad.to(device=self.chunks[bucket.index].device, dtype=self.chunks[bucket.index].dtype)
            if inv_scale != 1.0:
                g = g * inv_scale
            for where, piece in zip(bucket.pieces_in_chunk(self.rank), pieces):
                piece.grad = g[where.chunk_start:where.chunk_start + where.numel]
            grads.append(g)
        self._fp32_chunk_grads = grads
        return grads + self._host_grads

    def set_norm_skip(self, param_ids: set[int]) -> None:
        super().set_norm_skip(param_ids)
        # bucket index -> (start, numel) of the chunk's pieces that do count, for buckets holding a skipped one
        self._counted_ranges = {}
        for bucket in self.layout.buckets:
            pieces = bucket.pieces_in_chunk(self.rank)
            if any(id(self.flat_params.params[w.slot.index]) in self.norm_skip for w in pieces):
                self._counted_ranges[bucket.index] = [
                    (w.chunk_start, w.numel) for w in pieces
                    if id(self.flat_params.params[w.slot.index]) not in self.norm_skip]

    def _counted(self, bucket_indices: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` (chunks of the buckets ``bucket_indices``) without the skipped parameters' pieces."""
        ranges = getattr(self, "_counted_ranges", None)
        if not ranges:
            return grads
        out = []
        for b, g in zip(bucket_indices, grads):
            out.extend([g[s:s + n] for s, n in ranges[b]] if b in ranges else [g])
        return out

    def local_grad_norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm, as if every gradient were unscaled (a 0-dim
        float64 tensor on the device the gradients were reduced on)."""
        device = self.grad_store.chunk_grads[0].device if self.grad_store.chunk_grads else None
        resident = [b for b in range(len(self.layout.buckets)) if not self.on_host(b)]
        local = self.local_norm_sq(self._counted(resident, self._fp32_chunk_grads), device)
        if self._host_grads:  # unscaled by the factor squared: exact for the dynamic scaler's powers of two
            host = [b for b in range(len(self.layout.buckets))
                    if self.on_host(b) and self.grad_store.chunk_grads[b] is not None]
            local = local + self.local_norm_sq(self._counted(host, self._host_grads)).to(local.device) \
                * self._inv_scale ** 2
        return local

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        # Each rank holds a disjoint shard (padding is zero): the squares add up across ranks; under model
        # parallelism every rank's shard is of a different slice, so they add up over the whole world.
        return finite_sqrt(comm.all_reduce_value(self.local_grad_norm_sq(),
                                                 group=None if self.model_parallel else self.group))

    def _clip_grads(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        if self._fp32_chunk_grads:
            super()._clip_grads(self._fp32_chunk_grads, coef)
        self._clip_coef = coef  # offloaded buckets: applied on the host after unscaling, in the same order

    def _optimizer_step(self) -> None:
        if self.resident_buckets:
            with stepping(self.optimizer, self.resident_buckets):
                self.optimizer.step()  # only resident pieces have a .grad yet
        self.drop_resident_grads()
        self.step_offloaded()

    def drop_resident_grads(self) -> None:
        """The offloaded step calls the optimizer once per bucket: stepped pieces must not step again."""
        for b in self.resident_buckets:
            for piece in self.pieces[b]:
                piece.grad = None

    def step_offloaded(self, steps_applied: int | None = None) -> None:
        """After the resident buckets stepped: stream the offloaded ones through the CPU optimizer.
        ``steps_applied``: the steps taken before this one (the wrapper's count when a part of it)."""
        if self.offloaded_step is None:
            return
        steps = self.steps_applied if steps_applied is None else steps_applied
        if self.delayed is not None and steps >= self.delayed.warmup_steps:
            # The thread reads the clipping factor: no wait for the device here.
            self.delayed.start(self.grad_store.chunk_grads, self._inv_scale, self._clip_coef)
            return
        # The CPU optimizer needs the clipping factor on the host: offload's one wait for the device per step.
        self.offloaded_step.run(self.grad_store.chunk_grads, self._inv_scale, float(self._clip_coef),
                                self._offloaded_bucket_sink())

    def _offloaded_bucket_sink(self):
        """What to do with each bucket the offloaded step finishes (``bucket_done(b, values)``). Stages 1-2:
        all-gather each update while the CPU steps the next bucket (the resident ones, final already, first)."""
        buckets, refresh = self.layout.buckets, self.flat_params.start_refresh
        for b in self.resident_buckets:
            self._refreshing.append(refresh(buckets[b], self.chunks[b]))

        def bucket_done(b, values):
            self._refreshing.append(refresh(buckets[b], values))
            return self._refreshing[-1].wait_read

        return bucket_done

    def _refresh_model_params(self) -> None:
        # Stages 1-2 all-gather the updated chunks (Stage3Optimizer: only its local shard).
        if self._refreshing:  # the offloaded step already started every bucket's refresh
            pending, self._refreshing = self._refreshing, []
            self.flat_params.finish_refresh(pending)
            return
        self.flat_params.after_step(self._settled_chunks())

    def _settled_chunks(self) -> list[torch.Tensor | None]:
        """The chunks to write into the model now (None: a delayed update, written when it lands)."""
        return [None if self._in_flight(b) else chunk for b, chunk in enumerate(self.chunks)]

    def remove_hooks(self) -> None:
        if self.delayed is not None and self.delayed.pending and self.rank == 0:
            logging.getLogger("zeroengine").warning(
                "destroy(): the last delayed update (offload_optimizer.delayed_update) is in the masters but not "
                "in the module's weights; save_checkpoint before destroy() keeps it")
        self.discard_delayed_update()  # local: destroy() must not wait on other ranks
        self.grad_store.remove_hooks()
        if self.swapper is not None:
            self.swapper.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_store.zero()
        for b, pieces in enumerate(self.pieces):
            if self._in_flight(b):  # the background step sets and clears these itself
                continue
            for piece in pieces:
                piece.grad = None
        self._fp32_chunk_grads, self._host_grads = [], []

    def offload_buffers(self) -> list[torch.Tensor]:
        """Host buffers the offloaded step keeps (two buckets of fp32 gradients, two of 16-bit values; with
        delayed_update, the whole offloaded gradient shard in fp32)."""
        if self.offloaded_step is None:
            return []
        return (self.offloaded_step.held_tensors() + (self.delayed.held_tensors() if self.delayed else [])
                + (self.swapper.pool_tensors() if self.swapper else []))

    def memory_tally(self) -> MemoryTally:
        self.wait_if_creating_state()
        tally = MemoryTally()
        flat_ids = {id(p) for p in self.flat_params.params}
        tally.add("params", self.flat_params.held_tensors())
        tally.add("params", (p for p in self.module.parameters() if id(p) not in flat_ids))
        tally.add("grads", self.grad_store.held_tensors())
        tally.add("grads", self._fp32_chunk_grads)
        # Chunks that are views of the parameters were counted above; the rest are separate fp32 masters
        # (16-bit training, offloaded buckets, or resident copies of a shard offload_param keeps on the host).
        tally.add("master_params", self.chunks)
        tally.add("buffers", self.offload_buffers())
        self.add_nvme_tally(tally)
        tally.add_optimizer_state(self.optimizer)
        tally.add("buffers", self.module.buffers())
        tally.add("buffers", self.grad_store.comm_buffers())
        self.add_stage_tally(tally)
        return tally

    def add_nvme_tally(self, tally: MemoryTally) -> None:
        """The masters and optimizer state that live in swap files (offload_optimizer device "nvme")."""
        if self.swapper is not None:
            for kind, nbytes in self.swapper.nvme_bytes().items():
                tally.add_bytes(kind, "nvme", nbytes)

    def add_stage_tally(self, tally: MemoryTally) -> None:
        """What a stage holds beyond the parts every sharded stage has (stage 3: frozen and spare buffers)."""

    def checkpoint_params(self) -> list[torch.nn.Parameter]:
        return list(self.flat_params.params)

    def checkpoint_pieces(self) -> list[StatePiece]:
        self.wait_delayed_update()
        if self.swapper is not None:  # every value at once, until release_checkpoint_pieces
            self.swapper.materialize_all()
        params = self.flat_params.params
        return [StatePiece(params[where.slot.index], where.param_start, where.param_end, piece, piece)
                for bucket, pieces in zip(self.layout.buckets, self.pieces)
                for where, piece in zip(bucket.pieces_in_chunk(self.rank), pieces)]

    def after_checkpoint_load(self) -> None:
        if self.swapper is not None:
            self.swapper.materialize_all()
        self.flat_params.after_step(self.chunks)
        self.release_checkpoint_pieces(modified=True)

    def release_checkpoint_pieces(self, modified: bool = False) -> None:
        if self.swapper is not None:
            self.swapper.release_all(write=modified)
