"""offload_param on a CUDA device: parameters live in pinned CPU memory between uses."""
import pytest
import torch
from parity import base_config, engine_losses, global_batches, make_model, reference_run

import zeroengine
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


def test_built_on_cuda_under_init_with_cpu_slices_trains_with_partial_offload():
    """The path for a model larger than the GPU: built on the GPU one parameter at a time, slices (and the
    fp32 values the masters are cut from) in pinned CPU memory, half the Adam state on the GPU."""
    from model import GPT
    from parity import TINY

    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref_params = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
    cfg = base_config(4, 2, 1, 0.5, dtype="fp32", stage=3)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": 0.5}
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with zeroengine.zero.Init(config=cfg, remote_device="cpu", pin_memory=True), torch.device("cuda"):
        model = GPT(TINY)
    largest = max(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # one full parameter at a time on the GPU, never the model (~30k parameters, 15x the largest)
    assert torch.cuda.max_memory_allocated() - base <= 2 * largest + buffers
    shards = [zeroengine.zero.param_guard.info_of(p).init_shard.shard for p in model.parameters()]
    assert all(s.device.type == "cpu" and s.is_pinned() for s in shards)
    # built from the CUDA generator: give it the reference's initial values (as loading pretrained weights)
    want = dict(make_model().named_parameters())
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        for name, p in model.named_parameters():
            p.data.copy_(want[name].detach())
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    zero = engine.optimizer
    assert any(zero.on_host(b.index) for b in zero.layout.buckets)
    assert any(not zero.on_host(b.index) for b in zero.layout.buckets)
    losses = engine_losses(engine, global_batches(STEPS, 2, 1, 4), 0, 1, device="cuda")
    with GatheredParameters(list(engine.module.parameters())):
        params = {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-5)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


def test_init_slices_stay_in_cpu_memory_when_the_model_moves_to_cuda():
    """Built on the CPU with remote_device="cpu", then initialize() moves the model to the GPU: the slices
    stay in CPU memory (only the full values are gathered on the GPU), and training matches the reference."""
    from model import GPT
    from parity import TINY

    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, _ = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
    cfg = base_config(4, 2, 1, 0.5, dtype="fp32", stage=3)
    torch.manual_seed(0)
    with zeroengine.zero.Init(config=cfg, remote_device="cpu"):
        model = GPT(TINY)
    model.to("cuda")
    shards = [zeroengine.zero.param_guard.info_of(p).init_shard for p in model.parameters()]
    assert all(s.shard.device.type == "cpu" and s.compute_device.type == "cuda" for s in shards)
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    losses = engine_losses(engine, global_batches(STEPS, 2, 1, 4), 0, 1, device="cuda")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-5)
