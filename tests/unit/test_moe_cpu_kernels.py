"""The CPU kernels of the local MoE path against their PyTorch references: per-expert segments
(permutation split per expert, combine from separate expert outputs), grouped expert GEMMs, and
the weight-gradient workspace (reused only when nothing else holds it)."""
import pytest
import torch
import torch.nn as nn

from zeroengine.moe.grouped_cpu import GradWorkspace, expert_mlp
from zeroengine.ops import moe_dispatch
from zeroengine.ops.moe_dispatch import (
    backend,
    permute_tokens,
    permute_tokens_split,
    unpermute_combine,
    unpermute_combine_segments,
)

pytestmark = pytest.mark.skipif(backend("cpu") != "cpp", reason="moe_dispatch CPU kernel not built")


def _routing(tokens, experts, k, dropped, seed):
    """index/rows/counts of a random routing (each row named once; ``dropped`` assignments get -1)."""
    g = torch.Generator().manual_seed(seed)
    choice = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    keep = torch.ones(tokens, k, dtype=torch.bool)
    keep.view(-1)[torch.randperm(tokens * k, generator=g)[:dropped]] = False
    flat_e = torch.where(keep, choice, experts).reshape(-1)
    order = torch.argsort(flat_e, stable=True)[: int(keep.sum())]
    rows = torch.full((tokens * k,), -1, dtype=torch.long)
    rows[order] = torch.arange(order.numel())
    counts = torch.bincount(flat_e, minlength=experts + 1)[:experts].tolist()
    return order // k, rows.view(tokens, k), counts


class _OneTensorKernel:
    """Only the entry points the CUDA op has (no per-expert segments), over the CPU kernel: the path CUDA
    tensors take through permute_tokens_split / unpermute_combine_segments, exercised on the CPU."""

    def __init__(self, kernel):
        self.gather_rows, self.combine_rows = kernel.gather_rows, kernel.combine_rows
        self.combine_rows_backward = kernel.combine_rows_backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tokens,experts,k,dropped", [(40, 5, 2, 7), (33, 4, 1, 0), (6, 8, 2, 1)])
def test_segment_ops_match_single_tensor_reference(tokens, experts, k, dropped, dtype, monkeypatch):
    index, rows, counts = _routing(tokens, experts, k, dropped, seed=tokens)
    weights = torch.rand(tokens, k)
    x = torch.randn(tokens, 12, dtype=dtype)
    probe = torch.randn(tokens, 12, dtype=dtype)
    scale = [torch.randn(12, dtype=dtype) for _ in range(experts)]  # a different "expert" per segment
    runs = {}
    for impl in ("kernel", "torch", "one-tensor kernel"):
        if impl == "one-tensor kernel":
            monkeypatch.setitem(moe_dispatch._kernels, "cpu", _OneTensorKernel(moe_dispatch._kernels["cpu"]))
        xl, wl = x.clone().requires_grad_(), weights.clone().requires_grad_()
        impl = impl.split()[-1]
        chunks = permute_tokens_split(xl, index, rows, counts, impl=impl)
        assert [c.shape[0] for c in chunks] == counts
        ys = [c * s for c, s in zip(chunks, scale)]
        out = unpermute_combine_segments(ys, rows, wl, covers_all=True, impl=impl)
        (out * probe).sum().backward()
        runs[len(runs)] = (torch.cat(chunks).detach(), out.detach(), xl.grad, wl.grad)
    # the single-tensor ops (themselves tested against their references in test_moe_ops.py)
    xl, wl = x.clone().requires_grad_(), weights.clone().requires_grad_()
    permuted = permute_tokens(xl, index, rows, impl="torch")
    y = torch.cat([c * s for c, s in zip(permuted.split(counts), scale)])
    out = unpermute_combine(y, rows, wl, covers_all=True, impl="torch")
    (out * probe).sum().backward()
    want = (permuted.detach(), out.detach(), xl.grad, wl.grad)
    for got in runs.values():
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1, 7, 2], [4, 4], [0, 9, 0, 0, 1, 0, 0, 0, 2]])
@pytest.mark.parametrize("stacked,bias,act", [(True, True, nn.GELU()), (False, True, nn.SiLU()),
                                              (False, False, nn.ReLU())])
def test_grouped_kernel_matches_loop_reference(counts, stacked, bias, act):
    torch.manual_seed(len(counts))
    num, hidden, ffn = len(counts), 8, 16
    params = [torch.randn(num, ffn, hidden), torch.randn(num, ffn) if bias else None,
              torch.randn(num, hidden, ffn), torch.randn(num, hidden) if bias else None]
    params = [None if p is None else p.requires_grad_() for p in params]
    x, g = torch.randn(sum(counts), hidden), torch.randn(sum(counts), hidden)
    runs = []
    for impl in ("kernel", "torch"):
        for p in [*params, x]:
            if p is not None:
                p.grad = None
        xl = x.clone().requires_grad_()
        args = [p if p is None or stacked else list(p.unbind(0)) for p in params]
        y = expert_mlp(xl, counts, args[0], args[1], act, args[2], args[3], GradWorkspace(), impl=impl)
        y.backward(g)
        grads = []
        for p in params:
            if p is not None:
                grads.append(p.grad.clone())
        runs.append([y.detach(), xl.grad, *grads])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for e, c in enumerate(counts):  # an expert with no rows gets exact zeros
        if c == 0:
            assert not params[0].grad[e].any() and not params[2].grad[e].any()


def test_gradient_workspace_is_reused_only_when_free():
    w = nn.Parameter(torch.randn(3, 6, 4))
    x = torch.randn(5, 4)
    workspace = GradWorkspace()

    def step():
        y = expert_mlp(x, [2, 0, 3], w, None, nn.ReLU(), torch.ones(3, 4, 6), None, workspace)
        y.sum().backward()

    step()
    first, kept = w.grad, w.grad.clone()
    step()  # .grad still set: autograd accumulates into it; the workspace must not be that memory
    assert w.grad.data_ptr() == first.data_ptr()
    torch.testing.assert_close(w.grad, 2 * kept)
    w.grad = None
    step()
    torch.testing.assert_close(w.grad, kept)
    ptr = w.grad.data_ptr()
    w.grad = None
    step()  # nothing holds the buffer now: it is written again and adopted as .grad without a copy
    assert w.grad.data_ptr() == ptr
    torch.testing.assert_close(w.grad, kept)
    held = w.grad
    w.grad = None
    step()  # someone still holds last step's gradient: it gets fresh memory and stays intact
    assert w.grad.data_ptr() != held.data_ptr()
    torch.testing.assert_close(held, kept)
    torch.testing.assert_close(w.grad, kept)
    workspace.enabled = False
    w.grad = None
    step()
    assert w.grad.data_ptr() != held.data_ptr() and not workspace._buffers


def _set_threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    return old


# Shapes that reach every edge of the small-row GEMMs (moe_small_gemm_cpu.cpp): rows not a multiple of
# the 6 x 16 tile, past the 256-column contraction block and the 128-row block of the weight gradient,
# more rows than the kernels take (ATen runs those), experts with no rows, one-column outputs.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k_dim,n_dim,counts", [(7, 13, [0, 1, 5, 6, 7, 17, 33]), (300, 37, [130, 0, 129, 3, 1]),
                                                 (17, 1000, [257, 2, 300, 6, 1, 0]), (256, 258, [16, 15, 200]),
                                                 (513, 1, [1, 2, 3, 4, 5, 6, 7, 8])])
def test_grouped_gemms_match_torch_at_every_tile_edge(threads, k_dim, n_dim, counts):
    from zeroengine.ops.cpu_features import cpu_flags
    from zeroengine.ops.moe_dispatch import cpu_kernel

    kernel = cpu_kernel(torch.zeros(1), "kernel")
    if {"avx2", "fma"} <= cpu_flags():
        assert kernel.small_gemm_compiled()  # else these shapes would only test ATen's GEMMs
    torch.manual_seed(k_dim + n_dim)
    rows, num = sum(counts), len(counts)
    a, g = torch.randn(rows, k_dim), torch.randn(rows, n_dim)
    w, bias = [torch.randn(n_dim, k_dim) for _ in range(num)], [torch.randn(n_dim) for _ in range(num)]
    starts = [sum(counts[:e]) for e in range(num)]
    old = _set_threads(threads)
    try:
        for with_bias in (True, False):
            out = torch.full((rows, n_dim), float("nan"))
            kernel.grouped_rows_mm(a, w, counts, bias if with_bias else [], True, out)
            for e, (s, c) in enumerate(zip(starts, counts)):
                want = a[s:s + c] @ w[e].t() + (bias[e] if with_bias else 0)
                torch.testing.assert_close(out[s:s + c], want, rtol=1e-5, atol=1e-4)
        grad_a = torch.full((rows, k_dim), float("nan"))
        kernel.grouped_rows_mm(g, w, counts, [], False, grad_a)
        grad_w, grad_b = torch.full((num, n_dim, k_dim), float("nan")), torch.full((num, n_dim), float("nan"))
        kernel.grouped_weight_grad(g, a, counts, grad_w, grad_b)
    finally:
        torch.set_num_threads(old)
    for e, (s, c) in enumerate(zip(starts, counts)):
        torch.testing.assert_close(grad_a[s:s + c], g[s:s + c] @ w[e], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grad_w[e], g[s:s + c].t() @ a[s:s + c], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grad_b[e], g[s:s + c].sum(0), rtol=1e-5, atol=1e-4)


# The router's GEMMs (moe_router_cpu.cpp): experts past one 16-wide block and not a multiple of it, tokens
# past the 256-token forward block and not a multiple of the 6-row tile, contraction past 256, more
# threads than tokens, no tokens, and a size large enough to run threaded.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens,experts,dim", [(1, 1, 1), (3, 5, 7), (257, 37, 300), (600, 64, 512),
                                                (2, 70, 513), (0, 8, 16), (1100, 8, 24)])
def test_router_gemms_match_torch_at_every_tile_edge(threads, tokens, experts, dim):
    from zeroengine.ops.moe_dispatch import cpu_kernel

    kernel = cpu_kernel(torch.zeros(1), "kernel")
    if not kernel.small_gemm_compiled():
        pytest.skip("the small-row GEMMs need AVX2 + FMA")
    torch.manual_seed(tokens + experts + dim)
    x, wg, grad_logits = torch.randn(tokens, dim), torch.randn(experts, dim), torch.randn(tokens, experts)
    old = _set_threads(threads)
    try:
        logits = kernel.router_logits(x, wg)
        grad_wg = kernel.router_weight_grad(grad_logits, x)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(logits, x @ wg.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_wg, grad_logits.t() @ x, rtol=1e-5, atol=1e-4)


def test_router_gemms_refuse_what_they_do_not_take():
    from zeroengine.ops.moe_dispatch import cpu_kernel

    kernel = cpu_kernel(torch.zeros(1), "kernel")
    if not kernel.small_gemm_compiled():
        pytest.skip("the small-row GEMMs need AVX2 + FMA")
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-d float32"):
        kernel.router_logits(torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="router_logits: x is"):
        kernel.router_logits(torch.randn(4, 8), torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        kernel.router_weight_grad(torch.randn(4, 3), torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="router_weight_grad: grad_logits is"):
        kernel.router_weight_grad(torch.randn(5, 3), torch.randn(4, 8))


def test_grouped_gemms_with_an_empty_contraction_give_the_bias_or_zeros():
    from zeroengine.ops.moe_dispatch import cpu_kernel

    kernel = cpu_kernel(torch.zeros(1), "kernel")
    counts = [3, 2, 4, 1]
    w, bias = [torch.randn(5, 0) for _ in counts], [torch.full((5,), 2.0) for _ in counts]
    for with_bias in (True, False):
        out = torch.full((sum(counts), 5), 777.0)
        kernel.grouped_rows_mm(torch.randn(sum(counts), 0), w, counts, bias if with_bias else [], True, out)
        assert torch.equal(out, torch.full_like(out, 2.0 if with_bias else 0.0))


def test_grouped_gemms_refuse_mixed_dtypes_before_their_parallel_region():
    # an error thrown inside the OpenMP region would abort the process (terminate), not raise
    from zeroengine.ops.moe_dispatch import cpu_kernel

    kernel = cpu_kernel(torch.zeros(1), "kernel")
    counts, a = [2, 2, 2, 2], torch.randn(8, 4)
    old = _set_threads(2)
    try:
        with pytest.raises(RuntimeError, match="out must have a's dtype"):
            kernel.grouped_rows_mm(a, [torch.randn(3, 4) for _ in counts], counts, [], True,
                                   torch.empty(8, 3, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="b must have a's dtype"):
            kernel.grouped_weight_grad(a, torch.randn(8, 3, dtype=torch.float64), counts,
                                       torch.empty(4, 4, 3), None)
    finally:
        torch.set_num_threads(old)
