"""No host-device synchronisation between logging steps on CUDA (skipped without CUDA): steady-state
micro-steps and optimizer steps run under torch.cuda.set_sync_debug_mode("error"), which raises at any
synchronising CUDA call. Configs that need a decision on the host (fp16's loss scale, bf16's default
check_grad_overflow) wait once per optimizer step, in step(), and nowhere else.
tests/unit/test_host_reads.py counts the host reads behind such waits on CPU."""
import pytest
import torch
from parity import base_config, global_batches, make_model

import zeroengine

pytestmark = pytest.mark.gpu


def _run(stage: int, dtype: str, check_overflow: bool, sync_in_step: bool, steps: int = 3, gas: int = 2):
    cfg = base_config(4, gas, 1, 1.0, dtype=dtype, stage=stage)  # gradient clipping on: decided on the device
    cfg["steps_per_print"] = None
    if dtype == "bf16":
        cfg["bf16"]["check_grad_overflow"] = check_overflow
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    batches = [[tuple(t.cuda() for t in micro[0]) for micro in step]
               for step in global_batches(steps + 2, gas, 1, 4)]
    torch.cuda.synchronize()
    for i, step in enumerate(batches):
        guarded = i >= 2  # the first two steps record stage 3's order and warm everything up
        for x, y in step:
            torch.cuda.set_sync_debug_mode("error" if guarded else "default")
            try:
                engine.backward(engine(x, y))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.set_sync_debug_mode("error" if guarded and not sync_in_step else "default")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    loss = engine(*batches[0][0])
    assert torch.isfinite(loss)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_and_bf16_train_without_synchronising(stage):
    _run(stage, "fp32", check_overflow=False, sync_in_step=False)
    _run(stage, "bf16", check_overflow=False, sync_in_step=False)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_host_decision_waits_only_in_step(stage):
    _run(stage, "bf16", check_overflow=True, sync_in_step=True)  # micro-steps still never wait
    _run(stage, "fp16", check_overflow=True, sync_in_step=True)
