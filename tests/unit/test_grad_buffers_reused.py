"""Stages 2 and 3 reuse their per-step gradient buffers (bucket buffers, reduction outputs): after the first
step the gradient store allocates nothing, and each bucket's first reduction of a step writes into its gradient
chunk directly (no output buffer to add from)."""
import pytest
import torch
from parity import base_config, global_batches, make_model

import zeroengine
from zeroengine.zero import grad_stores


def _count_allocations(monkeypatch) -> list[int]:
    """Buffers the gradient store's pool had to allocate (a take it could not serve from what was given back)."""
    allocated = [0]
    take = grad_stores.BufferPool.take

    def counting_take(pool, numel, dtype, device, zeroed=False):
        if not any(t.numel() * t.element_size() >= numel * dtype.itemsize for t in pool.tensors()):
            allocated[0] += 1
        return take(pool, numel, dtype, device, zeroed)

    monkeypatch.setattr(grad_stores.BufferPool, "take", counting_take)
    return allocated


@pytest.mark.parametrize("stage", [2, 3])
def test_a_steady_step_allocates_no_gradient_buffers(stage, monkeypatch):
    cfg = base_config(2, 2, 1, 1.0, stage=stage)
    cfg["zero_optimization"]["reduce_bucket_size"] = 500  # several buckets
    torch.manual_seed(0)
    engine, opt, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    allocated, counts = _count_allocations(monkeypatch), []
    for step in global_batches(4, 2, 1, 2):
        before = allocated[0]
        for x, y in (m[0] for m in step):
            engine.backward(engine(x, y))
            engine.step()
        counts.append(allocated[0] - before)
    assert counts[0] > 0 and counts[2:] == [0, 0], counts
    # What the pools keep is counted in memory_breakdown's buffers: at most the buckets in use at once in a
    # steady backward (those in flight and those filling), each no larger than the largest bucket. At stage
    # 3 that needs the tied embedding's bucket last in launch order (zero/stage3.py split_params): its
    # gradient is complete only at the end of backward, and first it held every other bucket back.
    held = [t.nbytes for t in opt.grad_store.comm_buffers()]
    largest = max(b.padded_numel for b in opt.layout.buckets) * opt.grad_store.chunk_grads[0].element_size()
    assert len({b.padded_numel for b in opt.layout.buckets}) > 3
    assert 0 < len(held) <= 2 * (grad_stores.MAX_BUCKETS_IN_FLIGHT + 2) and max(held) <= largest, held
    assert opt.grad_store.peak_buckets_filling <= grad_stores.MAX_BUCKETS_IN_FLIGHT + 2, \
        opt.grad_store.peak_buckets_filling
