"""Full values of a sharded parameter, on demand (DeepSpeed's ``safe_get_full_*`` helpers).

Under ZeRO a rank holds a slice of each parameter's fp32 master, gradient and
optimizer state (and at stage 3 of the parameter itself), so ``param.grad`` is
None and a stage-3 ``param`` is empty. These functions return (or set) the
full tensors. The getters are collective: every rank calls them with the same
parameter, in the same order. The setters are local: every rank passes the
same full value and keeps its own slice.
"""
from __future__ import annotations

import torch

from zeroengine import comm

from .records import record_of


def _entry(param: torch.Tensor):
    record = record_of(param)
    if record is None:
        raise ValueError("this parameter is not sharded by a zeroengine ZeRO stage (1-3): at stage 0 read it and "
                         "its .grad directly (in fp16 training .grad is multiplied by engine.loss_scale until the "
                         "step unscales it)")
    if record.owner is not None:  # offload's delayed update: the masters and optimizer state are final then
        record.owner.wait_delayed_update()
    return record.owner, record.bucket, record.slot, record.shape


def _trained_entry(param: torch.Tensor):
    entry = _entry(param)
    if entry[0] is None:
        raise ValueError("this parameter is frozen (not given to the optimizer): it has no gradient or "
                         "optimizer state; read its value with safe_get_full_fp32_param")
    return entry


def _gather_slice(owner, bucket, slot, shape, chunk: torch.Tensor, buffer=None) -> torch.Tensor:
    buffer = buffer if buffer is not None else owner.flat_params
    chunk = chunk.to(buffer.device)  # offloaded chunks live on CPU; NCCL gathers device memory
    full = torch.empty(bucket.padded_numel, dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(full, chunk.contiguous(), group=buffer.group)
    start = slot.flat_start - bucket.flat_start
    return full[start:start + slot.numel].view(shape).clone()


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    owner, bucket, slot, shape = _entry(param)
    if owner is None:  # a frozen stage-3 parameter: its partitioned buffer is all there is
        buffer = record_of(param).buffer
        return _gather_slice(None, bucket, slot, shape, buffer.read_chunk(bucket).float(), buffer)
    return _gather_slice(owner, bucket, slot, shape, owner.chunks[bucket.index].float())


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The averaged, unscaled fp32 gradient reduced so far. Stage 1 reduces at the accumulation boundary
    only: None before it. Stages 2 and 3 reduce every micro-step: the sum over the micro-steps so far
    (zeros before any backward and after a step)."""
    owner, bucket, slot, shape = _trained_entry(param)
    chunk = owner.grad_store.chunk_grads[bucket.index]
    present = comm.all_reduce_scalar(0.0 if chunk is None else 1.0, op=comm.ReduceOp.MIN, group=owner.group)
    if present == 0.0:
        return None
    return _gather_slice(owner, bucket, slot, shape, chunk.float() / owner.loss_scale)


def safe_get_full_optimizer_state(param: torch.Tensor, key: str) -> torch.Tensor | None:
    """The full ``optimizer.state[param][key]`` (e.g. "exp_avg"); None before the first step."""
    owner, bucket, slot, shape = _trained_entry(param)
    chunk = torch.zeros(bucket.chunk_numel, dtype=torch.float32, device=owner.flat_params.device)
    found = 0.0
    for where, piece in zip(bucket.pieces_in_chunk(owner.rank), owner.pieces[bucket.index]):
        value = owner.optimizer.state.get(piece, {}).get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            chunk[where.chunk_start:where.chunk_start + where.numel] = value.float()
            found = 1.0
    if comm.all_reduce_scalar(found, op=comm.ReduceOp.MAX, group=owner.group) == 0.0:
        return None
    return _gather_slice(owner, bucket, slot, shape, chunk)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter (fp32 master and model copy) from a full value every rank passes alike."""
    owner, bucket, slot, shape = _trained_entry(param)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"value has shape {tuple(value.shape)}, the parameter {tuple(shape)}")
    flat = value.detach().reshape(-1)
    own = bucket.piece(slot, owner.rank)
    with torch.no_grad():
        if own is not None:
            owner.chunks[bucket.index][own.chunk_start:own.chunk_start + own.numel].copy_(
                flat[own.param_start:own.param_end])
        owner.flat_params.set_param_value(slot, bucket, flat)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, key: str) -> None:
    owner, bucket, slot, shape = _trained_entry(param)
    flat = value.detach().reshape(-1)
    for where, piece in zip(bucket.pieces_in_chunk(owner.rank), owner.pieces[bucket.index]):
        if where.slot.index == slot.index:
            state = owner.optimizer.state.get(piece)
            if state is None or key not in state:
                raise ValueError(f"optimizer state {key!r} does not exist yet (take one step first)")
            with torch.no_grad():
                state[key].copy_(flat[where.param_start:where.param_end])
