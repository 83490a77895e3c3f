"""Grouped-GEMM experts on one CUDA device (skipped without CUDA): the grouped compute (``_grouped_mm``
where it runs the dtype, padded bmm elsewhere) against the per-expert loop, values and gradients,
and the MoE layer's layouts against each other."""
import pytest
import torch
import torch.nn as nn

from zeroengine.moe import MoE
from zeroengine.moe.grouped import grouped_mlp_modules, grouped_mm_supported, mlp_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16: both sides round h and the products to 8 mantissa bits in a different order; gradients of
# magnitude 2-4 then differ by one or two bf16 ulps (0.016 each) in a few elements.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 36])  # 36 bf16 rows are not 16-byte aligned: the bmm path
@pytest.mark.parametrize("counts", [[5, 0, 17, 1, 9, 3], [5, 2, 17, 1, 9, 3]])  # an empty expert: bmm path
def test_grouped_matches_loop_on_cuda(dtype, hidden, counts):
    torch.manual_seed(0)
    experts = [nn.Sequential(nn.Linear(hidden, 128), nn.GELU(), nn.Linear(128, hidden)).cuda().to(dtype)
               for _ in range(6)]
    x = torch.randn(sum(counts), hidden, device="cuda", dtype=dtype, requires_grad=True)
    probe = torch.randn_like(x)
    print("grouped_mm", dtype, hidden, grouped_mm_supported(x, torch.empty(1, hidden, 128, device="cuda",
                                                                              dtype=dtype)))
    y = grouped_mlp_modules(experts, x, counts, mlp_spec(experts[0]))
    (y * probe).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for e in experts for p in e.parameters()]
    x.grad = None
    for e in experts:
        e.zero_grad()
    ref = torch.cat([e(c) for e, c in zip(experts, x.split(counts))])
    (ref * probe).sum().backward()
    want = [x.grad] + [p.grad for e in experts for p in e.parameters()]
    torch.testing.assert_close(y, ref, **TOL[dtype])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])


def test_layouts_agree_on_cuda():
    def build(**kw):
        torch.manual_seed(1)
        return MoE(64, nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), num_experts=8, k=2,
                   drop_tokens=False, **kw).cuda()

    x = torch.randn(300, 64, device="cuda")
    outs = [build(**kw)(x)[0] for kw in (dict(grouped="off"), dict(), dict(expert_layout="stacked"))]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-5, atol=1e-5)
