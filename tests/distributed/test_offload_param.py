"""offload_param (stage 3): between uses a parameter exists only as this rank's chunk in CPU memory.

Gathers copy the chunk up to the compute device first; the optimizer's
update lands in the CPU shard directly. On this CPU-only machine the copy is
a no-op, so these tests pin down placement and numbers; tests/gpu covers the
copies to and from a CUDA device.
"""
import pytest
from parity import base_config, engine_losses, global_batches, make_model, reference_run
from test_zero_parity import _assert_matches_reference, full_state

import zeroengine
from zeroengine.testing import run_distributed

STEPS = 6


def train_offloaded(rank, world, dtype, offload_optimizer):
    cfg = base_config(2, 2, world, 0.5, dtype=dtype, stage=3)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    shard = engine.optimizer.flat_params.shard
    assert shard.device.type == "cpu" and shard.dtype == engine.policy.param_dtype
    losses = engine_losses(engine, global_batches(STEPS, 2, world, 2), rank, world)
    mem = engine.memory_breakdown()
    assert mem["device"] == 0 and mem["cpu"] >= mem["params"] > 0
    return losses, full_state(engine), engine.global_steps


@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_offloaded_params_match_single_process(offload_optimizer):
    ref_losses, ref_params = reference_run(STEPS, 2, 2, micro=2, clip=0.5)
    results = run_distributed(train_offloaded, 2, "fp32", offload_optimizer)
    _assert_matches_reference(results, ref_losses, ref_params, tol=1e-5)


def test_offloaded_params_in_bf16_track_fp32():
    ref_losses, _ = reference_run(STEPS, 2, 2, micro=2, clip=0.5)
    for losses, _, _ in run_distributed(train_offloaded, 2, "bf16", True):
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 0.02 * want, (losses, ref_losses)  # bf16: see test_zero_parity


def test_offload_param_needs_stage_3():
    with pytest.raises(zeroengine.ConfigError) as err:
        zeroengine.config.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 2, "offload_param": {"device": "cpu"}}})
    assert "offload_param" in err.value.key_path or "offload_param" in str(err.value)
