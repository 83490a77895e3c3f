"""NVMe offload on a CUDA device: the parameters' chunks read from the drive into pinned pool buffers and
copied up for each gather, gradients copied down into the swapped optimizer's slots, updated values written
back. The swap moves bytes and never changes them, so each run equals the same run with CPU offload."""
import os

import pytest
import torch
from parity import base_config, engine_losses, global_batches, make_model, reference_run

import zeroengine
from zeroengine.zero import GatheredParameters

pytestmark = pytest.mark.gpu
STEPS = 6


def _train(dtype, offload_device, path, max_in_cpu=None):
    cfg = base_config(4, 2, 1, 0.5, dtype=dtype, stage=3)
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if offload_device == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "buffer_count": 3,
                                     "pipeline_read": True, "pipeline_write": True}
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_count": 2, "buffer_size": 1 << 20,
                                 **({} if max_in_cpu is None else {"max_in_cpu": max_in_cpu})}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    assert engine.device.type == "cuda"
    losses = engine_losses(engine, global_batches(STEPS, 2, 1, 4), 0, 1, device="cuda")
    nvme_bytes = engine.memory_breakdown()["nvme"]
    with GatheredParameters(list(engine.module.parameters())):
        params = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
    folder = engine.optimizer.swapper.folder.path if offload_device == "nvme" else None
    engine.destroy()
    if folder is not None:
        assert not os.path.exists(folder)  # the swap folder goes with the engine
    return losses, params, nvme_bytes


@pytest.mark.parametrize("dtype,max_in_cpu", [("fp32", None), ("bf16", None), ("bf16", 20_000)])
def test_nvme_offload_on_cuda_equals_cpu_offload(tmp_path, dtype, max_in_cpu):
    torch.backends.cuda.matmul.allow_tf32 = False
    want_losses, want_params, none_on_drive = _train(dtype, "cpu", str(tmp_path))
    losses, params, on_drive = _train(dtype, "nvme", str(tmp_path), max_in_cpu)
    assert none_on_drive == 0 and on_drive > 0
    assert losses == want_losses  # bitwise: the same kernels on the same bytes
    for name, want in want_params.items():
        assert torch.equal(params[name], want), name
    if dtype == "fp32":
        ref_losses, ref_params = reference_run(STEPS, 2, 1, micro=4, clip=0.5)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-4, rtol=1e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
