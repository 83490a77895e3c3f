"""offload_param on a CUDA device: parameters live in pinned CPU memory between uses."""
import pytest
import torch

import zeroengine
from parity import base_config, engine_losses, global_batches, make_model, reference_run
from zeroengine.zero import GatheredParameters

pytestmark = pytest.mark.gpu
STEPS = 6


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offloaded_params_on_cuda(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref_params = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
    cfg = base_config(4, 2, 1, 0.5, dtype=dtype, stage=3)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    shard = engine.optimizer.flat_params.shard
    assert shard.device.type == "cpu" and shard.is_pinned()
    losses = engine_losses(engine, global_batches(STEPS, 2, 1, 4), 0, 1, device="cuda")
    mem = engine.memory_breakdown()
    # Between steps no parameter is on the device (base_config sets the persistence threshold to 0).
    assert mem["cpu"] >= mem["params"] > 0
    with GatheredParameters(list(engine.module.parameters())):
        params = {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
    if dtype == "fp32":
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    else:
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 0.02 * want, (losses, ref_losses)
