"""Full parameter, gradient and optimizer state of a sharded parameter, on demand (stages 1-3)."""
import pytest
import torch
from parity import ADAM_EPS, base_config, global_batches, make_model

import zeroengine
from zeroengine.testing import run_distributed
from zeroengine.zero import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)

NAMES = ["blocks.0.attn.qkv.weight", "wte.weight", "ln_f.bias"]


def _probe(rank, world, stage):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=base_config(2, 1, world, 0.0, stage=stage))
    params = dict(engine.module.named_parameters())
    x, y = global_batches(1, 1, world, 2)[0][0][rank]
    engine.backward(engine(x, y))
    grads = {n: safe_get_full_grad(params[n]) for n in NAMES}
    engine.step()
    values = {n: safe_get_full_fp32_param(params[n]) for n in NAMES}
    exp_avg = {n: safe_get_full_optimizer_state(params[n], "exp_avg") for n in NAMES}
    safe_set_full_fp32_param(params["ln_f.bias"], torch.full((32,), 0.25))
    after_set = safe_get_full_fp32_param(params["ln_f.bias"])
    return grads, values, exp_avg, after_set


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_values_match_the_single_process_reference(stage):
    world = 2
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
    step = global_batches(1, 1, world, 2)[0][0]
    model(torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])).backward()
    params = dict(model.named_parameters())
    ref_grads = {n: params[n].grad.clone() for n in NAMES}
    opt.step()
    for grads, values, exp_avg, after_set in run_distributed(_probe, world, stage):
        for n in NAMES:
            torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(values[n], params[n].detach(), atol=1e-5, rtol=0)  # the parity tolerance
            torch.testing.assert_close(exp_avg[n], opt.state[params[n]]["exp_avg"], atol=1e-7, rtol=1e-5)
        assert torch.equal(after_set, torch.full((32,), 0.25))
