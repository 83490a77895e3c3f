"""MoE on one CUDA device (skipped without CUDA): the CUDA permutation kernels against the PyTorch
reference, and the MoE layer on the GPU against the same layer on the CPU."""
import pytest
import torch
import torch.nn as nn

from zeroengine.moe import MoE
from zeroengine.ops import moe_dispatch as md

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _routing(tokens, k, experts, drop_every, device):
    g = torch.Generator().manual_seed(0)
    choice = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    flat = choice.t().reshape(-1).clone()
    if drop_every:
        flat[::drop_every] = experts
    order = torch.argsort(flat, stable=True)
    kept = order[flat[order] < experts]
    rows = torch.full((k * tokens,), -1, dtype=torch.long)
    rows[kept] = torch.arange(kept.numel())
    return (kept % tokens).to(device), rows.view(k, tokens).t().contiguous().to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,drop,hidden", [(1, 0, 64), (2, 3, 1024), (2, 0, 37)])
def test_cuda_kernels_match_reference(dtype, k, drop, hidden):
    assert md.backend("cuda", dtype) == "cuda"
    index, rows = _routing(301, k, 8, drop, "cuda")
    results = {}
    for impl in ("kernel", "torch"):
        torch.manual_seed(1)
        x = torch.randn(301, hidden, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.rand(301, k, device="cuda", requires_grad=True)
        permuted = md.permute_tokens(x, index, rows, impl=impl)
        y = permuted * 1.5
        out = md.unpermute_combine(y, rows, w, covers_all=True, impl=impl)
        out.backward(torch.ones_like(out))
        results[impl] = (permuted.detach(), out.detach(), x.grad, w.grad)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(results["kernel"], results["torch"]):
        torch.testing.assert_close(got, want, **tol)


def test_moe_layer_on_cuda_matches_cpu():
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    cpu = MoE(64, expert, num_experts=8, k=2, drop_tokens=False)
    gpu = MoE(64, expert, num_experts=8, k=2, drop_tokens=False)
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x = torch.randn(500, 64)
    outs = []
    for layer, inp in ((cpu, x.clone().requires_grad_()), (gpu, x.cuda().requires_grad_())):
        out, l_aux, counts = layer(inp)
        (out.pow(2).sum() + l_aux).backward()
        outs.append((out.detach().cpu(), l_aux.detach().cpu(), counts.cpu(), inp.grad.cpu(),
                     layer.local_experts[3][0].weight.grad.cpu()))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
