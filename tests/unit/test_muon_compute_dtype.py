"""The dtype Muon's Newton-Schulz runs in (zeroengine/optim/muon.py: ns_compute_dtype) is the one DeepSpeed 0.19.8
picks through its accelerator's is_fp16_supported / is_bf16_supported, so a DeepSpeed Muon run moved here follows
the same trajectory on any GPU. Checked on a faked GPU of each compute capability (no GPU needed)."""
import pytest
import torch

from zeroengine.optim.muon import ns_compute_dtype

CUDA = torch.device("cuda")


@pytest.mark.parametrize("capability, allow_deprecated, expected", [
    ((9, 0), None, torch.float16),
    ((7, 0), None, torch.float16),
    ((6, 1), None, torch.float32),  # fp16 on 6.x is deprecated: DeepSpeed falls back to fp32
    ((6, 1), "1", torch.float16),   # unless DS_ALLOW_DEPRECATED_FP16=1
    ((5, 2), "1", torch.float32),
])
def test_gram_runs_fp16_on_the_gpus_deepspeed_runs_it_on(monkeypatch, capability, allow_deprecated, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if allow_deprecated is None:
        monkeypatch.delenv("DS_ALLOW_DEPRECATED_FP16", raising=False)
    else:
        monkeypatch.setenv("DS_ALLOW_DEPRECATED_FP16", allow_deprecated)
    assert ns_compute_dtype("gram", CUDA) == expected


@pytest.mark.parametrize("bf16_supported, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_standard_runs_bf16_where_the_gpu_has_it(monkeypatch, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    assert ns_compute_dtype("standard", CUDA) == expected
