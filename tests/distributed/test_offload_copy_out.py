"""Offloaded 16-bit training: the C++ CPU Adam writes the 16-bit copy in its own pass.

The fused copy-out must be invisible in the numbers: the same run with the
separate conversion pass gives bit-identical weights. So must partial offload
(offload_optimizer.ratio): resident buckets unscale, clip, step and convert in
that order too.
"""
import pytest
import torch
from parity import make_model
from test_checkpoint_reshard import config, full_state, train

import zeroengine
from zeroengine.testing import run_distributed


def offloaded_bf16(rank, world, stage, fused):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=config(world, stage, "bf16", offload=True))
    zero = engine.optimizer
    step = zero.offloaded_step
    assert type(zero.optimizer).__name__ == "CPUAdam" and step.copy_buffers is not None
    # two pinned staging buffers of the largest bucket, however many buckets (not a 16-bit copy of the shard)
    largest = max(b.chunk_numel for b in zero.layout.buckets)
    assert len(zero.layout.buckets) > 2
    assert [(b.dtype, b.numel()) for b in step.copy_buffers] == [(torch.bfloat16, largest)] * 2
    assert sum(t.numel() * t.element_size() for t in zero.offload_buffers()) == 2 * largest * (4 + 2)
    calls = []
    if fused:
        real = zero.optimizer.step_with_copy
        zero.optimizer.step_with_copy = lambda targets: calls.append(len(targets)) or real(targets)
    else:
        step.copy_buffers = None  # the plain path: step, then convert the masters on the way back
    losses = train(engine, rank, world, 0, 3)
    buckets = len(zero.layout.buckets)  # the offloaded step streams one bucket at a time
    assert len(calls) == (3 * buckets if fused else 0) and all(n > 0 for n in calls)
    return losses, full_state(engine)


@pytest.mark.parametrize("stage", [2, 3])
def test_fused_copy_out_equals_the_separate_conversion(stage):
    fused = run_distributed(offloaded_bf16, 2, stage, True)
    plain = run_distributed(offloaded_bf16, 2, stage, False)
    for (losses_f, state_f), (losses_p, state_p) in zip(fused, plain):
        assert losses_f == losses_p
        for name, value in state_p.items():
            assert torch.equal(state_f[name], value), name


def partially_offloaded(rank, world, stage, ratio, dtype):
    cfg = config(world, stage, dtype, offload=True)
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    zero = engine.optimizer
    resident = [b.index for b in zero.layout.buckets if not zero.on_host(b.index)]
    host = [b.chunk_numel for b in zero.layout.buckets if zero.on_host(b.index)]
    assert all(buf.numel() == max(host) for buf in zero.offloaded_step.copy_buffers)
    return train(engine, rank, world, 0, 3), full_state(engine), len(resident)


@pytest.mark.parametrize("stage,dtype", [(2, "bf16"), (3, "bf16"), (2, "fp16")])
def test_partial_offload_equals_full_offload_bitwise(stage, dtype):
    """fp16: the loss scale is unscaled where each gradient lives, by the same factor, in the same order."""
    full = run_distributed(partially_offloaded, 2, stage, 1.0, dtype)
    partial = run_distributed(partially_offloaded, 2, stage, 0.5, dtype)
    for (losses_f, state_f, resident_f), (losses_p, state_p, resident_p) in zip(full, partial):
        assert resident_f == 0 and resident_p > 0
        assert losses_f == losses_p
        for name, value in state_f.items():
            assert torch.equal(state_p[name], value), name
