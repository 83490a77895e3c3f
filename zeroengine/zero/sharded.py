"""Stages 1 and 2: each rank steps only its shard of the optimizer state (and master weights).

The optimizer never sees a model parameter. It steps *pieces*: for every
bucket, this rank's chunk split at parameter boundaries, each piece put in
the torch param group its parameter belonged to (so per-group lr and weight
decay hold). In fp32 training a piece is a view into the flat parameter
buffer, so stepping it updates the model in place (no master copy: DESIGN.md's
K = 8); in 16-bit training it is a view into an fp32 master chunk. After the
step, each bucket's updated chunks are all-gathered into every rank's
parameters. Stage 1 and stage 2 differ only in their gradient store
(:mod:`zeroengine.zero.grad_stores`).
"""
from __future__ import annotations

import math

import torch

from zeroengine import comm
from zeroengine.memory import MemoryTally
from zeroengine.offload import OffloadedStep

from .flat_params import gather_chunk
from .layout import FlatLayout
from .optimizer import StatePiece, ZeroOptimizer


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
        # offload_optimizer: fp32 masters (and so the optimizer state, created beside them) live in
        # CPU memory, pinned when an accelerator copies to and from them.
        self.offload = offload
        if policy.mixed:
            self.chunks = [gather_chunk(fp32_values, b, rank, torch.float32) for b in buckets]
        else:
            self.chunks = [flat_params.chunk_view(b, rank) for b in buckets]
        if offload is not None:
            self.chunks = [self._to_host(c) for c in self.chunks]
        self.pieces = [self._pieces_of(i) for i in range(len(buckets))]
        # Offloaded 16-bit training with the C++ CPU Adam: the kernel writes each updated value out in
        # the model's dtype in the same pass (into pinned buffers), so the copy back needs no conversion.
        self.copy_out: list[torch.Tensor] | None = None
        if offload is not None and policy.mixed and hasattr(optimizer, "step_with_copy"):
            self.copy_out = [self._host_buffer(c.shape, policy.param_dtype).copy_(c) for c in self.chunks]
        # Offload: the step streams gradients down bucket by bucket (zeroengine/offload/step.py).
        self.offloaded_step = None if offload is None else OffloadedStep(
            optimizer, self.layout, rank, self.pieces, self.copy_out, bool(offload.pin_memory))
        self._inv_scale, self._clip_coef = 1.0, 1.0
        self._refreshing: list[tuple] = []
        self._fp32_chunk_grads: list[torch.Tensor] = []
        self._after_backward = after_backward

    def _to_host(self, chunk: torch.Tensor) -> torch.Tensor:
        return self._host_buffer(chunk.shape, torch.float32).copy_(chunk)

    def _host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu",
                           pin_memory=bool(self.offload.pin_memory) and torch.cuda.is_available())

    @property
    def has_master_copy(self) -> bool:
        """True when the stepped chunks are separate fp32 tensors (16-bit training, or offload)."""
        return self.policy.mixed or self.offload is not None

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
        self.grad_store.begin_backward(is_boundary)

    def finish_backward(self, is_boundary: bool) -> None:
        self.grad_store.finish_backward(is_boundary)
        if self._after_backward is not None:
            self._after_backward()

    def load_chunk_from_params(self, bucket_index: int) -> None:
        """Stage 3: a parameter was edited in place (GatheredParameters); make the master chunk follow."""
        bucket = self.layout.buckets[bucket_index]
        src = self.flat_params.chunk_view(bucket, self.rank)
        if self.chunks[bucket_index].data_ptr() != src.data_ptr():
            self.chunks[bucket_index].copy_(src)

    def _unscaled_fp32_grads(self, inv_scale: float) -> list[torch.Tensor]:
        if self.offloaded_step is not None:
            # The gradients stay where they were reduced, loss-scaled; the step unscales them on the host.
            self._inv_scale, self._clip_coef = inv_scale, 1.0
            return [g for g in self.grad_store.chunk_grads if g is not None]
        grads = []
        for bucket, chunk_grad, pieces in zip(self.layout.buckets, self.grad_store.chunk_grads, self.pieces):
            if chunk_grad is None:  # never happens after a backward; zeros keep a bare step() well-defined
                chunk_grad = torch.zeros(bucket.chunk_numel, device=self.chunks[bucket.index].device)
            g = chunk_grad.to(device=self.chunks[bucket.index].device, dtype=torch.float32)
            if inv_scale != 1.0:
                g = g * inv_scale
            for where, piece in zip(bucket.pieces_in_chunk(self.rank), pieces):
                piece.grad = g[where.chunk_start:where.chunk_start + where.numel]
            grads.append(g)
        self._fp32_chunk_grads = grads
        return grads

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        # Each rank holds a disjoint shard (padding is zero): the squares add up across ranks.
        local = self.local_norm_sq(grads)
        if self.offloaded_step is not None:
            local *= self._inv_scale ** 2  # exact for the dynamic scaler's powers of two
        total = comm.all_reduce_scalar(local, group=self.group)
        return math.sqrt(total) if math.isfinite(total) else float("inf")

    def _clip_grads(self, grads: list[torch.Tensor], coef: float) -> None:
        if self.offloaded_step is not None:
            self._clip_coef = coef  # applied on the host, after unscaling, as the in-memory path orders it
        else:
            super()._clip_grads(grads, coef)

    def _optimizer_step(self) -> None:
        if self.offloaded_step is None:
            super()._optimizer_step()
            return
        values = self._updated_values()
        refresh = getattr(self.flat_params, "start_refresh", None)  # stages 1-2: overlap the copy back
        bucket_done = None if refresh is None else (
            lambda b: self._refreshing.append(refresh(self.layout.buckets[b], values[b])))
        self.offloaded_step.run(self.grad_store.chunk_grads, self._inv_scale, self._clip_coef, bucket_done)

    def _updated_values(self) -> list[torch.Tensor]:
        """What a step leaves to send back: the 16-bit copies the CPU Adam wrote (offloaded mixed precision,
        where ``copy_out`` exists), else the updated chunks."""
        return self.copy_out if self.copy_out is not None else self.chunks

    def _refresh_model_params(self) -> None:
        # Stages 1-2 all-gather the updated chunks; stage 3 only refreshes its local shard.
        if self._refreshing:  # the offloaded step already started every bucket's refresh
            pending, self._refreshing = self._refreshing, []
            self.flat_params.finish_refresh(pending)
            return
        self.flat_params.after_step(self._updated_values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_store.zero()
        for pieces in self.pieces:
            for piece in pieces:
                piece.grad = None
        self._fp32_chunk_grads = []

    def memory_tally(self) -> MemoryTally:
        tally = MemoryTally()
        flat_ids = {id(p) for p in self.flat_params.params}
        tally.add("params", self.flat_params.held_tensors())
        tally.add("params", (p for p in self.module.parameters() if id(p) not in flat_ids))
        tally.add("grads", self.grad_store.held_tensors())
        tally.add("grads", self._fp32_chunk_grads)
        if self.has_master_copy:
            tally.add("master_params", self.chunks)
        if self.copy_out is not None:
            tally.add("buffers", self.copy_out)
        if self.offloaded_step is not None:
            tally.add("buffers", self.offloaded_step.held_tensors())
        tally.add_optimizer_state(self.optimizer)
        tally.add("buffers", self.module.buffers())
        tally.add("buffers", self.grad_store.comm_buffers())
        return tally

    def checkpoint_params(self) -> list[torch.nn.Parameter]:
        return list(self.flat_params.params)

    def checkpoint_pieces(self) -> list[StatePiece]:
        params = self.flat_params.params
        return [StatePiece(params[where.slot.index], where.param_start, where.param_end, piece, piece)
                for bucket, pieces in zip(self.layout.buckets, self.pieces)
                for where, piece in zip(bucket.pieces_in_chunk(self.rank), pieces)]

    def after_checkpoint_load(self) -> None:
        self.flat_params.after_step(self.chunks)
