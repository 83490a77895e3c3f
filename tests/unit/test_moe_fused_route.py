"""The one-node route + gather path (zeroengine/moe/fused_route.py) and the single-threaded expert group
(zeroengine/moe/expert_group.py) against a pure-PyTorch MoE: outputs, l_aux, input and weight gradients."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroengine.moe.expert_group as expert_group
import zeroengine.moe.fused_route as fused_route
from zeroengine.moe import MoE
from zeroengine.moe.expert_group import intra_op_threads, run_expert_modules, wants_serial
from zeroengine.moe.fused_gate import topk_gate_reference
from zeroengine.ops.moe_dispatch import backend

pytestmark = pytest.mark.skipif(backend("cpu") != "cpp", reason="moe_dispatch CPU kernel not built")

H = 16


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return x * self.w


def _mlp():
    return nn.Sequential(nn.Linear(H, 24), nn.GELU(), nn.Linear(24, H))


def _reference(moe, x):
    """The layer in plain PyTorch: router by its definition, then every expert on its kept tokens."""
    gate = moe.gate
    logits = F.linear(x, gate.wg.weight)
    r = topk_gate_reference(logits, logits, gate.k, gate.capacity(x.shape[0]), gate.k > 1)
    out = torch.zeros_like(x)
    experts = moe.local_experts
    for e in range(moe.num_experts):
        token, j = torch.nonzero((r["expert_index"] == e) & r["kept"], as_tuple=True)
        out = out.index_add(0, token, _run_expert(experts, e, x[token]) * r["weights"][token, j].unsqueeze(1))
    return out, r["l_aux"], r["exp_counts"]


def _run_expert(experts, e, x):
    if hasattr(experts, "w1"):  # stacked parameters: expert e's slices, so gradients reach them
        h = experts.activation(F.linear(x, experts.w1[e], experts.b1[e]))
        return F.linear(h, experts.w2[e], experts.b2[e])
    return experts[e](x)


def _grads(moe, x, fn):
    moe.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    out, l_aux, counts = fn(leaf)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    ((out * probe).sum() + 3.0 * l_aux).backward()
    return out.detach(), l_aux.detach(), counts, leaf.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}


class _WithoutSmallGemm:
    """The CPU kernel as a host without AVX2 + FMA (or with ZEROENGINE_MOE_SMALL_GEMM=0) sees it."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def small_gemm_enabled(self):
        return False


@pytest.mark.parametrize("small_gemm", [True, False])  # False: the router's GEMMs and grad assembly by ATen
@pytest.mark.parametrize("expert,k,drop", [("scale", 1, False), ("scale", 2, True), ("mlp", 1, True),
                                           ("mlp", 2, False), ("stacked", 2, True)])
def test_matches_pytorch_reference(expert, k, drop, small_gemm, monkeypatch):
    if not small_gemm:
        real_kernel = fused_route.cpu_kernel
        monkeypatch.setattr(fused_route, "cpu_kernel", lambda x, impl: None if real_kernel(x, impl) is None
                            else _WithoutSmallGemm(real_kernel(x, impl)))
    torch.manual_seed(0)
    template = Scale() if expert == "scale" else _mlp()
    moe = MoE(H, template, num_experts=6, k=k, capacity_factor=0.8, min_capacity=1, drop_tokens=drop,
              expert_layout="stacked" if expert == "stacked" else "modules")
    moe.init_experts(lambda m: [nn.init.normal_(p, std=0.5) for p in m.parameters()], seed=2)
    x = torch.randn(70, H)
    calls = []
    real = fused_route._RouteGather.apply
    monkeypatch.setattr(fused_route._RouteGather, "apply", lambda *a: calls.append(1) or real(*a))
    got = _grads(moe, x, moe)
    assert calls, "the fused route did not run"
    want = _grads(moe, x, lambda t: _reference(moe, t))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)
    assert got[4].keys() == want[4].keys()
    for n in got[4]:
        torch.testing.assert_close(got[4][n], want[4][n], rtol=1e-5, atol=1e-5, msg=n)


def test_applies_only_to_the_plain_gate():
    torch.manual_seed(0)
    x = torch.randn(8, H)
    assert fused_route.applies(MoE(H, Scale(), num_experts=4).gate, x, "auto")
    assert not fused_route.applies(MoE(H, Scale(), num_experts=4).gate, x, "torch")
    assert not fused_route.applies(MoE(H, Scale(), num_experts=4, z_loss_coef=0.1).gate, x, "auto")
    assert not fused_route.applies(MoE(H, Scale(), num_experts=4, noisy_gate_policy="Jitter").gate, x, "auto")
    assert not fused_route.applies(MoE(H, Scale(), num_experts=4, k=2, second_expert_policy="random").gate, x,
                                   "auto")
    hooked = MoE(H, Scale(), num_experts=4).gate
    hooked.register_forward_hook(lambda *a: None)
    assert not fused_route.applies(hooked, x, "auto")
    assert not fused_route.applies(MoE(H, Scale(), num_experts=4).gate, x.double(), "auto")


class _ThreadProbe(torch.autograd.Function):
    """Identity that records the intra-op thread count it runs under, forward and backward."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        _ThreadProbe.seen.append(("forward", torch.get_num_threads()))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _ThreadProbe.seen.append(("backward", torch.get_num_threads()))
        return g


class _Probed(Scale):
    def forward(self, x):
        return _ThreadProbe.apply(super().forward(x))


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs more than one intra-op thread")
def test_expert_group_runs_single_threaded_and_matches_the_module_loop(monkeypatch):
    monkeypatch.setattr(expert_group, "PARALLEL_FROM", 1)  # tiny batches here
    torch.manual_seed(0)
    experts = nn.ModuleList(_Probed() for _ in range(5))
    for e in experts:
        nn.init.normal_(e.w)
    chunks = [torch.randn(n, H) for n in (3, 0, 7, 2, 5)]
    probe = [torch.randn(c.shape) for c in chunks]
    results = []
    for serial_below in (1 << 20, 0):
        _ThreadProbe.seen = []
        experts.zero_grad(set_to_none=True)
        leaves = [c.clone().requires_grad_() for c in chunks]
        ys = run_expert_modules(experts, leaves, serial_below)
        sum((y * p).sum() for y, p in zip(ys, probe)).backward()
        results.append(([y.detach() for y in ys], [t.grad for t in leaves], [e.w.grad.clone() for e in experts],
                        _ThreadProbe.seen))
    (ys, gx, gw, seen), (ys_ref, gx_ref, gw_ref, seen_ref) = results
    threads = torch.get_num_threads()
    assert {s for s in seen} == {("forward", 1), ("backward", 1)} and len(seen) == 10
    assert all(n == threads for _, n in seen_ref)
    for a, b in zip(ys + gx + gw, ys_ref + gx_ref + gw_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_expert_group_gives_parameter_gradients_to_autograd_grad(monkeypatch):
    monkeypatch.setattr(expert_group, "PARALLEL_FROM", 1)
    torch.manual_seed(0)
    experts = nn.ModuleList(Scale() for _ in range(3))
    chunks = [torch.randn(2, H, requires_grad=True) for _ in range(3)]
    ys = run_expert_modules(experts, chunks, 1 << 20)
    params = [e.w for e in experts]
    grads = torch.autograd.grad(sum(y.sum() for y in ys), params + chunks)
    for e, c, g in zip(experts, chunks, grads[:3]):
        torch.testing.assert_close(g, c.detach().sum(0))
    for e, g in zip(experts, grads[3:]):
        torch.testing.assert_close(g, e.w.detach().expand(2, H))
    assert all(p.grad is None for p in params)


def test_expert_group_refuses_a_second_backward_and_restores_threads(monkeypatch):
    monkeypatch.setattr(expert_group, "PARALLEL_FROM", 1)
    threads = torch.get_num_threads()
    experts = nn.ModuleList(Scale() for _ in range(2))
    ys = run_expert_modules(experts, [torch.randn(2, H, requires_grad=True) for _ in range(2)], 1 << 20)
    loss = sum(y.sum() for y in ys)
    loss.backward(retain_graph=True)
    if torch.get_num_threads() > 1 or threads > 1:
        with pytest.raises(RuntimeError, match="one backward"):
            loss.backward()
    assert torch.get_num_threads() == threads
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs more than one intra-op thread")
def test_wants_serial_for_small_batches_that_torch_would_thread():
    small = [torch.empty(64, 512)] * 64  # 64 experts, 4096 tokens, top-1: 32768 elements each
    assert wants_serial(small, 1 << 16)
    assert not wants_serial(small, 0)
    assert not wants_serial([torch.empty(512, 512)] * 8, 1 << 16)  # 8 experts: large batches stay threaded
    assert not wants_serial([torch.empty(8, 32)] * 8, 1 << 16)  # torch runs these single-threaded anyway
    with intra_op_threads(1):
        assert not wants_serial(small, 1 << 16)


@pytest.mark.parametrize("small_gemm", [True, False])
def test_cpu_autocast_leaves_the_router_in_fp32(small_gemm, monkeypatch):
    # the ATen fallback's logits GEMM came out bf16 under autocast, and the fused gate kernel refused them
    if not small_gemm:
        real_kernel = fused_route.cpu_kernel
        monkeypatch.setattr(fused_route, "cpu_kernel", lambda x, impl: None if real_kernel(x, impl) is None
                            else _WithoutSmallGemm(real_kernel(x, impl)))
    torch.manual_seed(0)
    moe = MoE(H, Scale(), num_experts=4, k=2, drop_tokens=False)  # elementwise experts: nothing to autocast
    x = torch.randn(40, H)
    want = _grads(moe, x, moe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(moe, x, moe)
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name in want[4]:
        torch.testing.assert_close(got[4][name], want[4][name], rtol=0, atol=0)
