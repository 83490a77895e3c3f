"""``stage3_fetch_unit: "block"``: each transformer block gathers its parameters in one fetch (as an FSDP2
fully_shard'ed block) instead of module by module; the numbers are the same, the fetch events fewer."""
import pytest
import torch
from parity import base_config, engine_losses, global_batches, make_model, reference_run

import zeroengine
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters

STEPS, GAS, MICRO = 3, 2, 2


def _train(rank, world, unit):
    cfg = base_config(MICRO, GAS, world, 1.0, stage=3)
    cfg["zero_optimization"]["stage3_fetch_unit"] = unit
    engine, opt, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    opt.flat_params.stats.record_labels = True
    losses = engine_losses(engine, global_batches(STEPS, GAS, world, MICRO), rank, world)
    labels = {label for label, _ in opt.flat_params.stats.labels}
    with GatheredParameters(list(engine.module.parameters())):
        params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, params, opt.fetch_stats()["trace_events"], labels


@pytest.mark.parametrize("world", [2, 4])
def test_block_fetches_train_as_module_fetches_and_as_plain_torch(world):
    ref_losses, ref_params = reference_run(STEPS, GAS, world, MICRO, clip=1.0)
    by_module = run_distributed(_train, world, "module")[0]
    by_block = run_distributed(_train, world, "block")[0]
    assert by_block[0] == by_module[0]  # the same values gathered, the same arithmetic
    for name, ref in ref_params.items():
        torch.testing.assert_close(by_block[1][name], by_module[1][name], rtol=0, atol=0)
        torch.testing.assert_close(by_block[1][name], ref, rtol=0, atol=1e-5)  # as test_zero_parity
    torch.testing.assert_close(torch.tensor(by_block[0]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # The tiny GPT's 2 blocks hold 6 parameter-owning modules each: a pass's fetch events drop from one per
    # module call to one per block call, and the gathers name the blocks.
    assert by_block[2] < by_module[2] / 2, (by_block[2], by_module[2])
    assert any(label.startswith("module blocks.0 (") for label in by_block[3]), by_block[3]
    assert not any(label.startswith("module blocks.0.") for label in by_block[3]), by_block[3]
