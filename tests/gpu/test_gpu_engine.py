"""The engine on one CUDA device with NCCL (skipped without CUDA): the CPU parity suite at world size 1."""
import pytest
import torch
from parity import base_config, engine_losses, global_batches, make_model, reference_run

import zeroengine
from zeroengine.zero import GatheredParameters

pytestmark = pytest.mark.gpu
STEPS = 6


def _train(stage, dtype, gas=2, clip=0.5, offload=False, ratio=1.0):
    cfg = base_config(4, gas, 1, clip, dtype=dtype, stage=stage)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": ratio}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    if offload:
        mem = engine.memory_breakdown()
        assert mem["cpu"] >= mem["master_params"] > 0  # masters (and, after a step, Adam state) in host memory
        zero = engine.optimizer
        for b in zero.layout.buckets:  # offloaded buckets pinned in host memory, resident ones on the GPU
            chunk = zero.chunks[b.index]
            assert (chunk.is_pinned() and chunk.device.type == "cpu") if zero.on_host(b.index) else chunk.is_cuda
    assert engine.device.type == "cuda"
    losses = engine_losses(engine, global_batches(STEPS, gas, 1, 4), 0, 1, device="cuda")
    with GatheredParameters(list(engine.module.parameters())):
        return losses, {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_on_cuda_matches_cpu_reference(stage):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref_losses, ref_params = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
    losses, params = _train(stage, "fp32")
    # CPU vs GPU kernels sum in different orders: 1e-5 relative on the loss, 1e-4 on weights after 6 Adam steps.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-5)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_on_cuda_tracks_fp32(stage, dtype):
    ref_losses, _ = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
    losses, _ = _train(stage, dtype)
    tol = 0.02 if dtype == "bf16" else 0.01
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= tol * want, (losses, ref_losses)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_offload_on_cuda_tracks_fp32(stage):
    ref_losses, _ = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
    losses, _ = _train(stage, "bf16", offload=True)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 0.02 * want, (losses, ref_losses)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partial_optimizer_offload_on_cuda_matches_cpu_reference(stage):
    """ratio 0.5: half the buckets' Adam state on the GPU (CPUAdam steps them with the CUDA kernel), half in
    pinned host memory; fp32 so the result is compared with the CPU reference like the in-memory path."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref_params = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
    losses, params = _train(stage, "fp32", offload=True, ratio=0.5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-5)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
