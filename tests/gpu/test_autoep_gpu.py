"""AutoEP's experts on one CUDA device (skipped without CUDA): the grouped GEMMs (``torch._grouped_mm`` where it
runs the dtype and every expert has rows) against the per-expert loop, values and gradients."""
import pytest
import torch

from zeroengine.moe.autoep import swiglu_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16: the two paths round the products to 8 mantissa bits in a different order (see test_moe_grouped_gpu).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 2, 17, 1, 9, 3], [5, 0, 17, 1, 9, 3]])  # an empty expert: the loop
def test_grouped_swiglu_matches_the_loop(dtype, counts):
    torch.manual_seed(0)
    hidden, inter = 64, 32
    gate_up = (torch.randn(6, 2 * inter, hidden, device="cuda") * 0.1).to(dtype).requires_grad_()
    down = (torch.randn(6, hidden, inter, device="cuda") * 0.1).to(dtype).requires_grad_()
    x = torch.randn(sum(counts), hidden, device="cuda", dtype=dtype, requires_grad=True)
    act = torch.nn.SiLU()
    results = []
    for grouped in (True, False):
        y = swiglu_rows(x, counts, gate_up, down, act, grouped_mm=grouped)
        grads = torch.autograd.grad(y.float().square().sum(), (x, gate_up, down))
        results.append((y, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL[dtype])
