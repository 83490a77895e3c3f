"""MoE permutation ops: the C++ kernel against the PyTorch reference (values and gradients),
gradcheck of the op definitions, the fallback, and the CUDA source compiling with nvcc."""
import pytest
import torch

from zeroengine.ops import moe_dispatch as md
from zeroengine.ops.builder import find_nvcc
from zeroengine.ops.op_builders import MoEDispatchCUDABuilder


def _routing(tokens, k, experts, drop_every=0, seed=0):
    """index/rows of a random top-k routing, in expert-sorted order, some assignments dropped."""
    g = torch.Generator().manual_seed(seed)
    choice = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    flat = choice.t().reshape(-1)  # choice-major, as the gate orders priorities
    if drop_every:
        flat = flat.clone()
        flat[::drop_every] = experts  # sorted past every real expert: dropped
    order = torch.argsort(flat, stable=True)
    kept = order[flat[order] < experts]
    rows = torch.full((k * tokens,), -1, dtype=torch.long)
    rows[kept] = torch.arange(kept.numel())
    rows = rows.view(k, tokens).t().contiguous()
    index = kept % tokens
    return index, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("k,drop", [(1, 0), (2, 0), (2, 3)])
@pytest.mark.parametrize("hidden", [24, 77])  # 77: the fp32 dot's 32-wide steps, an 8-wide step and a tail
def test_kernel_matches_reference(dtype, k, drop, hidden):
    if md.backend("cpu", dtype) != "cpp":
        pytest.skip("moe_dispatch C++ op not available here")
    tokens, experts = 37, 5
    index, rows = _routing(tokens, k, experts, drop)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    results = {}
    for impl in ("kernel", "torch"):
        torch.manual_seed(1)
        x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
        w = torch.rand(tokens, k, requires_grad=True)
        expert_w = torch.randn(hidden, hidden, dtype=dtype)
        permuted = md.permute_tokens(x, index, rows, impl=impl)
        y = permuted @ expert_w  # something row-wise between the two ops
        out = md.unpermute_combine(y, rows, w, covers_all=True, impl=impl)
        probe = torch.randn(tokens, hidden, dtype=dtype, generator=torch.Generator().manual_seed(2))
        (out.float() * probe.float()).sum().backward()
        results[impl] = (permuted.detach(), out.detach(), x.grad, w.grad)
    for got, want in zip(results["kernel"][:3], results["torch"][:3]):
        torch.testing.assert_close(got, want, **tol)
    # The weights' gradient is a dot product over hidden whose terms (|y| ~ sqrt(hidden)) are several
    # times the result: kernel and reference sum in different orders, a few ulps of those terms apart.
    w_tol = tol if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["kernel"][3], results["torch"][3], **w_tol)
    # dropped assignments contribute nothing and get a zero weight gradient
    assert torch.all(results["kernel"][3][rows < 0] == 0)


def test_permute_then_combine_with_unit_weights_round_trips():
    tokens, hidden = 16, 8
    index, rows = _routing(tokens, 2, 4)
    x = torch.randn(tokens, hidden)
    out = md.unpermute_combine(md.permute_tokens(x, index, rows), rows)
    torch.testing.assert_close(out, 2 * x)  # every token has two copies, both kept


@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_gradcheck(impl):
    index, rows = _routing(9, 2, 3, drop_every=4)
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(index.numel(), 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(9, 2, dtype=torch.float32)
    torch.autograd.gradcheck(lambda x: md.permute_tokens(x, index, rows, impl=impl), (x,))
    torch.autograd.gradcheck(lambda y: md.unpermute_combine(y, rows, w, covers_all=True, impl=impl), (y,))
    # the weight gradient (fp32 weights): compare against finite differences by hand
    w = w.requires_grad_()
    y0 = y.detach()
    out = md.unpermute_combine(y0, rows, w, impl=impl)
    g = torch.randn_like(out)
    (grad_w,) = torch.autograd.grad(out, w, g)
    expected = torch.stack([(g[t] * y0[rows[t, j]]).sum() if rows[t, j] >= 0 else torch.zeros((), dtype=y0.dtype)
                            for t in range(9) for j in range(2)]).view(9, 2).float()
    torch.testing.assert_close(grad_w, expected, rtol=1e-5, atol=1e-6)


def test_kernel_rejects_out_of_range_rows():
    if md.backend("cpu") != "cpp":
        pytest.skip("moe_dispatch C++ op not available here")
    y = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        md.unpermute_combine(y, torch.tensor([[0], [5]]), impl="kernel")
    with pytest.raises(RuntimeError, match="out of range"):
        md.permute_tokens(y, torch.tensor([3]), torch.tensor([[0]]), impl="kernel")


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl"):
        md.permute_tokens(torch.zeros(2, 2), torch.tensor([0]), torch.tensor([[0], [-1]]), impl="fast")


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_cuda_source_compiles(tmp_path):
    objects = MoEDispatchCUDABuilder().compile_only(tmp_path)
    assert [o.name for o in objects] == ["moe_dispatch.o"] and objects[0].stat().st_size > 0
