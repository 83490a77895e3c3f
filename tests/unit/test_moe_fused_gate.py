"""The fused top-k gate kernel (ops/csrc/moe/moe_gate_cpu.cpp) against its PyTorch definition
(values and gradients), and TopKGate routing through it exactly as through its PyTorch path."""
import pytest
import torch

from zeroengine.moe import MoE, TopKGate
from zeroengine.moe.dispatch import DispatchPlan
from zeroengine.moe.fused_gate import RoutedGateOutput, topk_gate_fused, topk_gate_reference
from zeroengine.ops.moe_dispatch import backend

pytestmark = pytest.mark.skipif(backend("cpu") != "cpp", reason="moe_dispatch CPU kernel not built")

INTS = ("expert_index", "kept", "exp_counts", "kept_counts", "first_counts", "rows", "index", "order")


def _logits(tokens, experts, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g) * 2


@pytest.mark.parametrize("tokens,experts,k,capacity", [(37, 4, 1, None), (37, 4, 2, None), (300, 8, 1, 30),
                                                       (300, 8, 2, 50), (2000, 64, 2, 40), (5, 3, 3, 2)])
def test_kernel_matches_reference_values_and_gradients(tokens, experts, k, capacity):
    logits = _logits(tokens, experts, seed=tokens + k)
    select = logits + 0.5 * _logits(tokens, experts, seed=1)  # choose by other scores than the weights' softmax
    probe = torch.randn(tokens, k)
    results = {}
    for name, fn in (("kernel", topk_gate_fused), ("reference", topk_gate_reference)):
        leaf = logits.clone().requires_grad_()
        kw = {"impl": "kernel"} if name == "kernel" else {}
        r = fn(leaf, select, k, capacity, k > 1, **kw)
        ((r["weights"] * probe).sum() + 3.0 * r["l_aux"]).backward()
        results[name] = (r, leaf.grad)
    (got, got_grad), (want, want_grad) = results["kernel"], results["reference"]
    for key in INTS:
        assert torch.equal(got[key], want[key]), key
    assert capacity is None or int(got["kept_counts"].max()) <= capacity
    torch.testing.assert_close(got["weights"], want["weights"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["l_aux"], want["l_aux"], rtol=1e-5, atol=1e-6)
    # p * (gp - <p, gp>) cancels: an entry near 0 carries float32 rounding of |gp| ~ 1 (~1e-7 each).
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_gradient_with_only_one_output_used():
    logits = _logits(50, 6, seed=3)
    for use in ("weights", "l_aux"):
        grads = []
        for fn, kw in ((topk_gate_fused, {"impl": "kernel"}), (topk_gate_reference, {})):
            leaf = logits.clone().requires_grad_()
            r = fn(leaf, leaf.detach(), 2, 10, True, **kw)
            r[use].sum().backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k,drop_tokens,z_loss", [(1, True, 0.0), (2, True, 0.1), (2, False, 0.0)])
def test_gate_output_same_through_kernel_and_pytorch_path(k, drop_tokens, z_loss, monkeypatch):
    torch.manual_seed(0)
    gate = TopKGate(16, 6, k=k, capacity_factor=0.7, drop_tokens=drop_tokens, z_loss_coef=z_loss)
    x = torch.randn(90, 16)
    fused = gate(x)
    assert isinstance(fused, RoutedGateOutput)
    monkeypatch.setattr("zeroengine.moe.fused_gate.route_fused", lambda *a: None)
    plain = gate(x)
    assert not isinstance(plain, RoutedGateOutput)
    for field in ("expert_index", "routed", "kept", "exp_counts", "kept_counts", "order"):
        assert torch.equal(getattr(fused, field), getattr(plain, field)), field
    assert fused.capacity == plain.capacity and fused.num_dropped == plain.num_dropped
    torch.testing.assert_close(fused.weights, plain.weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fused.l_aux, plain.l_aux, rtol=1e-6, atol=1e-7)
    # The kernel's dispatch maps are the ones the dispatcher derives from `order`.
    a, b = DispatchPlan.from_gate(fused), DispatchPlan.from_gate(plain)
    assert torch.equal(a.index, b.index) and torch.equal(a.rows, b.rows) and a.counts == b.counts


def test_random_routing_policies_keep_the_pytorch_path():
    torch.manual_seed(0)
    x = torch.randn(40, 8)
    assert not isinstance(TopKGate(8, 4, k=2, second_expert_policy="random")(x), RoutedGateOutput)
    assert not isinstance(TopKGate(8, 4, k=1, use_rts=True)(x), RoutedGateOutput)
    assert isinstance(TopKGate(8, 4, k=2, second_expert_policy="random").eval()(x), RoutedGateOutput)


def test_moe_layer_gradients_same_through_kernel_and_pytorch_path(monkeypatch):
    torch.manual_seed(1)
    layer = MoE(16, torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)),
                num_experts=4, k=2, capacity_factor=0.8)
    x = torch.randn(64, 16)
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr("zeroengine.moe.fused_gate.route_fused", lambda *a: None)
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out, l_aux, _ = layer(leaf)
        (out.pow(2).sum() + l_aux).backward()
        runs.append([out.detach(), leaf.grad] + [p.grad.clone() for p in layer.parameters()])
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
