"""Stages 1-3: memory_breakdown() against docs/concepts.md's formulas, and bytes on the wire per step."""
import pytest
import torch
from parity import base_config, global_batches, make_model

import zeroengine
from zeroengine import comm
from zeroengine.testing import run_distributed

# docs/concepts.md, model states per rank in bytes per parameter: (replicated, sharded over N)
FORMULA = {
    ("fp32", 1): (8, 8), ("fp32", 2): (4, 12), ("fp32", 3): (0, 16),
    ("bf16", 1): (4, 12), ("bf16", 2): (2, 14), ("bf16", 3): (0, 16),
}


def _measure(rank, world, stage, dtype, offload=False, keep_gathered=True):
    cfg = base_config(2, 1, world, clip=1.0, dtype=dtype, stage=stage)
    cfg["zero_optimization"]["reduce_bucket_size"] = 20_000
    if not keep_gathered:  # stage 3 re-gathers every module for backward: DeepSpeed's 3Ψ(N-1)/N per step
        cfg["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    layout = engine.optimizer.layout
    psi = layout.param_numel  # (stage 3's module parameters are empty between uses)
    wire = None
    for step in global_batches(2, 1, world, 2):
        comm.counters.reset()
        x, y = step[0][rank]
        engine.backward(engine(x, y))
        mem = engine.memory_breakdown()  # after backward, before step: gradients are held
        engine.step()
        wire = comm.counters.snapshot()
    return psi, layout.total_numel, len(layout.buckets), mem, wire


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype,world", [("fp32", 2), ("fp32", 4), ("bf16", 4)])
def test_memory_breakdown_matches_design_formula(stage, dtype, world):
    psi, padded, _, mem, _ = run_distributed(_measure, world, stage, dtype)[0]
    replicated, sharded = FORMULA[(dtype, stage)]
    model_states = sum(mem[k] for k in ("params", "grads", "optimizer_states", "master_params"))
    formula = replicated * psi + sharded * psi / world
    assert abs(model_states - formula) <= 0.05 * formula, (model_states, formula)
    # zeroengine.estimate_memory predicts the same, kind by kind, before anything runs
    predicted = zeroengine.estimate_memory(psi, world, stage, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    assert predicted["total"] == formula
    for kind in ("params", "grads", "master_params", "optimizer_states"):
        assert abs(mem[kind] - predicted[kind]) <= 0.05 * formula, (kind, mem[kind], predicted[kind])
    # and exactly, with the layout's alignment padding counted
    width = 4 if dtype == "fp32" else 2
    assert mem["params"] == (width * padded if stage < 3 else width * padded // world)
    assert mem["grads"] == (width * padded if stage == 1 else width * padded // world)
    assert mem["master_params"] == (0 if dtype == "fp32" else 4 * padded // world)
    assert mem["optimizer_states"] <= 8 * padded // world  # padding is never stepped, so it has no state
    assert mem["optimizer_states"] >= 8 * psi // world - 8 * (padded - psi)


@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_on_the_wire_equal_plain_data_parallel(stage):
    world = 2
    psi, padded, buckets, _, wire = run_distributed(_measure, world, stage, "fp32")[0]
    # one reduce-scatter and one all-gather of every (padded) bucket per step ...
    assert wire["reduce_scatter"]["calls"] == wire["all_gather"]["calls"] == buckets
    sharded_bytes = wire["reduce_scatter"]["wire_bytes"] + wire["all_gather"]["wire_bytes"]
    assert sharded_bytes == pytest.approx(4 * 2 * padded * (world - 1) / world)
    # ... which is plain data parallel's 2Ψ(N-1)/N elements, up to < N*align padding per bucket
    assert 0 <= padded - psi < buckets * world * 16
    # the only other traffic is the one-number gradient-norm reduction
    assert wire["all_reduce"]["calls"] == 1 and wire["all_reduce"]["payload_bytes"] == 8


def test_stage3_moves_one_and_a_half_times_data_parallel():
    world = 2
    psi, padded, buckets, _, wire = run_distributed(_measure, world, 3, "fp32", False, False)[0]
    # forward and backward each gather every bucket once; backward reduce-scatters each once
    assert wire["all_gather"]["calls"] == 2 * buckets and wire["reduce_scatter"]["calls"] == buckets
    total = wire["all_gather"]["wire_bytes"] + wire["reduce_scatter"]["wire_bytes"]
    assert total == pytest.approx(3 * 4 * padded * (world - 1) / world)  # 3Ψ(N-1)/N elements, 1.5x stages 1-2
    assert 0 <= padded - psi < buckets * world * 16
    # with the default reuse distance, a unit still gathered when backward needs it again is not re-gathered
    _, _, _, _, kept = run_distributed(_measure, world, 3, "fp32")[0]
    assert buckets <= kept["all_gather"]["calls"] <= 2 * buckets
    assert kept["all_gather"]["wire_bytes"] + kept["reduce_scatter"]["wire_bytes"] <= total


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_offload_keeps_an_fp32_master_shard_beside_its_state(stage):
    world = 2
    psi, padded, _, mem, _ = run_distributed(_measure, world, stage, "fp32", True)[0]
    # fp32 training steps the parameters in place; offloaded, it steps fp32 masters in CPU
    # memory instead (DeepSpeed's ZeRO-Offload): 4 bytes per owned element more, plus the state.
    assert mem["master_params"] == 4 * padded // world
    assert mem["optimizer_states"] >= 8 * psi // world - 8 * (padded - psi)
    predicted = zeroengine.estimate_memory(psi, world, stage, offload_optimizer=True)
    assert abs(mem["master_params"] - predicted["master_params"]) <= 0.05 * predicted["master_params"]
    assert predicted["cpu"] == predicted["master_params"] + predicted["optimizer_states"]


def _scratch(rank, world, stage):
    from zeroengine.comm.scratch import scratch

    scratch.clear()
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=base_config(2, 1, world, 0.0, stage=stage))
    for step in global_batches(2, 1, world, 2):
        x, y = step[0][rank]
        engine.backward(engine(x, y))
        engine.step()
    without = engine.optimizer.memory_tally().as_dict()
    return scratch.held_bytes(), engine.memory_breakdown(), without


@pytest.mark.parametrize("stage", [2, 3])
def test_the_gloo_collectives_kept_temporaries_are_reported_as_buffers(stage):
    # gloo's reduce-scatter / all-gather run through full-size temporaries kept for reuse: memory this rank
    # holds, so memory_breakdown() reports it (under "buffers", and in "cpu")
    held, mem, without = run_distributed(_scratch, 2, stage)[0]
    assert held > 0
    assert mem["buffers"] == without["buffers"] + held
    assert mem["cpu"] == without["cpu"] + held


def test_a_world_of_one_keeps_no_collective_temporaries():
    held, mem, without = run_distributed(_scratch, 1, 2)[0]
    assert held == 0 and mem == without
