"""engine.compile() and the compile config section: each block's forward under torch.compile (CPU inductor) at
ZeRO stages 0-3, with and without offload, and with activation checkpointing, trains as the eager engine does
(fp32, 1e-5), on 2 ranks."""
import pytest
import torch
from parity import base_config, engine_losses, global_batches, make_model

import zeroengine
from zeroengine.checkpointing import checkpoint_modules
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters

STEPS, GAS, MICRO = 3, 2, 2

CASES = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3),
    "stage2_offload": dict(stage=2, offload_optimizer={"device": "cpu"}),
    "stage3_offload": dict(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}),
    "stage3_by_config": dict(stage=3, by_config=True),  # "compile": {"enabled": true} instead of engine.compile()
    "stage3_checkpointed": dict(stage=3, checkpointed=True),  # every block's activations recomputed
}


def _train(rank, world, case: dict, compiled: bool):
    cfg = base_config(MICRO, GAS, world, 1.0, stage=case["stage"])
    for key in ("offload_optimizer", "offload_param"):
        if key in case:
            cfg["zero_optimization"][key] = case[key]
    if compiled and case.get("by_config"):
        cfg["compile"] = {"enabled": True, "backend": "inductor"}
    model = make_model()
    if case.get("checkpointed"):
        checkpoint_modules(model, "Block")
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    if compiled and not case.get("by_config"):
        engine.compile()
    assert engine.is_compiled == compiled
    losses = engine_losses(engine, global_batches(STEPS, GAS, world, MICRO), rank, world)
    with GatheredParameters(list(engine.module.parameters())):
        params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    stats = engine.optimizer.fetch_stats() if case["stage"] == 3 else None
    engine.destroy()
    return losses, params, stats


def _compare_all(rank, world):
    from torch._dynamo.utils import counters

    out = {}
    for name, case in CASES.items():
        eager = _train(rank, world, case, compiled=False)
        torch._dynamo.reset()  # compile afresh (the frame is cached on Block.forward's code), count it
        counters.clear()
        compiled = _train(rank, world, case, compiled=True)
        out[name] = (eager, compiled, dict(counters["frames"]), dict(counters["graph_break"]))
    return out


@pytest.mark.timeout(660)  # above run_distributed's 600 s, so a hang fails naming the rank
def test_compiled_blocks_train_as_the_eager_engine_at_every_stage_and_offload():
    for rank, results in enumerate(run_distributed(_compare_all, 2, timeout_s=600)):
        for name, ((losses, params, stats), (c_losses, c_params, c_stats), frames, breaks) in results.items():
            torch.testing.assert_close(torch.tensor(c_losses), torch.tensor(losses), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{name}: {m}")
            # Inductor fuses and reorders fp32 reductions (softmax, layer norm): gradients differ from eager's
            # by rounding (~1e-7 relative), which Adam's normalised update (lr 1e-2) turns into ~1e-5 absolute on
            # weights whose gradient is near zero. Plain torch shows the same: this model trained 3 steps with
            # and without per-block torch.compile (no zeroengine) ends 8.8e-6 apart. Weights are O(0.02-1).
            for key, value in params.items():
                torch.testing.assert_close(c_params[key], value, rtol=0, atol=3e-5,
                                           msg=lambda m: f"{name} {key}: {m}")
            # The two blocks share one compiled frame, with no graph break inside it.
            assert frames.get("ok", 0) >= 1 and breaks == {}, (name, frames, breaks)
            if stats is not None:  # stage 3 gathers each block's parameters as one fetch now: fewer events
                assert c_stats["trace_events"] < stats["trace_events"], (name, c_stats, stats)
