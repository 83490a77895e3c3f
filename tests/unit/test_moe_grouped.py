"""Grouped GEMMs for standard-MLP experts: the grouped compute against a per-expert loop (values and
gradients, padded and equal batches, empty experts), the MoE layer in every layout against the
token-by-token reference, and what the stacked layout means for tags, names and initialisation."""
import pytest
import torch
import torch.nn as nn

from zeroengine.moe import MoE, expert_checkpoint_names, expert_checkpoint_places, expert_tag, is_expert_param
from zeroengine.moe.experts import ExpertList
from zeroengine.moe.grouped import GroupedMLPExperts, grouped_mlp, grouped_mlp_modules, mlp_spec

H, F = 8, 16


def _expert(act=nn.GELU(), bias=True):
    return nn.Sequential(nn.Linear(H, F, bias=bias), act, nn.Linear(F, H, bias=bias))


def _init(expert):
    for p in expert.parameters():
        nn.init.normal_(p, std=0.3)


def _experts(n, seed, **kw):
    torch.manual_seed(seed)
    out = [_expert(**kw) for _ in range(n)]
    for e in out:
        _init(e)
    return out


def _loop(experts, x, counts):
    return torch.cat([e(c) for e, c in zip(experts, x.split(counts))])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [4, 4, 4, 4], [0, 0, 7, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("act,bias", [(nn.GELU(), True), (nn.ReLU(), False), (nn.SiLU(), True)])
def test_grouped_matches_per_expert_loop(counts, act, bias):
    experts = _experts(len(counts), seed=sum(counts), act=act, bias=bias)
    spec = mlp_spec(experts[0])
    assert spec is not None and spec.bias1 == bias
    x = torch.randn(sum(counts), H, requires_grad=True)
    probe = torch.randn(sum(counts), H)
    got = grouped_mlp_modules(experts, x, counts, spec)
    (got * probe).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for e in experts for p in e.parameters()]
    for e in experts:
        e.zero_grad()
    x.grad = None
    want = _loop(experts, x, counts)
    if sum(counts):
        (want * probe).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wants = [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for e in experts
                        for p in e.parameters()]
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), rtol=1e-5, atol=1e-5)


def test_grouped_mlp_takes_stacked_weights_directly():
    experts = _experts(3, seed=5)
    w1 = torch.stack([e[0].weight for e in experts]).detach().requires_grad_()
    b1 = torch.stack([e[0].bias for e in experts]).detach().requires_grad_()
    w2 = torch.stack([e[2].weight for e in experts]).detach().requires_grad_()
    b2 = torch.stack([e[2].bias for e in experts]).detach().requires_grad_()
    x, counts = torch.randn(9, H), [2, 6, 1]
    y = grouped_mlp(x, counts, w1, b1, nn.GELU(), w2, b2)
    torch.testing.assert_close(y, _loop(experts, x, counts), rtol=1e-5, atol=1e-5)
    y.pow(2).sum().backward()
    _loop(experts, x, counts).pow(2).sum().backward()
    torch.testing.assert_close(w1.grad, torch.stack([e[0].weight.grad for e in experts]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b2.grad, torch.stack([e[2].bias.grad for e in experts]), rtol=1e-5, atol=1e-5)


def test_only_standard_mlps_are_grouped():
    class MyLinear(nn.Linear):
        pass

    assert mlp_spec(_expert()) is not None
    assert mlp_spec(nn.Sequential(MyLinear(H, F), nn.GELU(), nn.Linear(F, H))) is None  # forward may differ
    assert mlp_spec(nn.Sequential(nn.Linear(H, F), nn.LayerNorm(F), nn.Linear(F, H))) is None  # not elementwise
    assert mlp_spec(nn.Sequential(nn.Linear(H, F), nn.GELU())) is None
    experts = ExpertList([_expert(), _expert()])
    assert experts.use_grouped()
    handle = experts[1][0].register_forward_hook(lambda m, i, o: None)
    assert not experts.use_grouped()  # a hook needs the module's own forward
    handle.remove()
    with pytest.raises(ValueError, match="grouped"):
        MoE(H, nn.Sequential(nn.Linear(H, H)), num_experts=2, grouped="on")
    with pytest.raises(ValueError, match="stacked"):
        MoE(H, nn.Sequential(nn.Linear(H, H)), num_experts=2, expert_layout="stacked")


def _token_by_token(moe, experts, x):
    routing = moe.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.k):
            if routing.kept[t, j]:
                out[t] += routing.weights[t, j] * experts[int(routing.expert_index[t, j])](x[t:t + 1])[0]
    return out, routing


@pytest.mark.parametrize("layout,grouped", [("modules", "on"), ("stacked", "auto"), ("modules", "off")])
@pytest.mark.parametrize("k,drop_tokens", [(1, True), (2, True), (2, False)])
def test_layer_matches_token_by_token_reference(layout, grouped, k, drop_tokens):
    torch.manual_seed(k)
    moe = MoE(H, _expert(), num_experts=4, k=k, capacity_factor=0.75, min_capacity=1, drop_tokens=drop_tokens,
              expert_layout=layout, grouped=grouped)
    moe.init_experts(_init, seed=3)
    torch.manual_seed(k)
    ref_moe = MoE(H, _expert(), num_experts=4, k=k, capacity_factor=0.75, min_capacity=1,
                  drop_tokens=drop_tokens, grouped="off")  # the same gate, per-expert modules
    ref_moe.init_experts(_init, seed=3)
    x = torch.randn(23, H, requires_grad=True)
    probe = torch.randn(23, H)
    out, l_aux, _ = moe(x)
    ((out * probe).sum() + l_aux).backward()
    xg = x.grad.clone()
    x.grad = None
    ref, routing = _token_by_token(ref_moe, list(ref_moe.local_experts), x)
    assert (routing.num_dropped > 0) == drop_tokens
    ((ref * probe).sum() + routing.l_aux).backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xg, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe.gate.wg.weight.grad, ref_moe.gate.wg.weight.grad, rtol=1e-5, atol=1e-5)
    ref_grads = [[p.grad for p in e.parameters()] for e in ref_moe.local_experts]
    if layout == "stacked":
        st = moe.local_experts
        got = [[st.w1.grad[i], st.b1.grad[i], st.w2.grad[i], st.b2.grad[i]] for i in range(4)]
    else:
        got = [[p.grad for p in e.parameters()] for e in moe.local_experts]
    for g_e, r_e in zip(got, ref_grads):
        for g, r in zip(g_e, r_e):
            torch.testing.assert_close(g, r if r is not None else torch.zeros_like(g), rtol=1e-5, atol=1e-5)


def test_stacked_layout_tags_names_and_initialisation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), MoE(H, _expert(), num_experts=3, expert_layout="stacked"))
    stacked = model[1].local_experts
    assert isinstance(stacked, GroupedMLPExperts) and len(stacked) == 3
    assert stacked.w1.shape == (3, F, H) and stacked.b2.shape == (3, H)
    tags = {expert_tag(p) for p in stacked.parameters()}
    assert len(tags) == 1 and (t := tags.pop()).expert_id == 0 and t.count == 3 and t.ep_size == 1
    assert not is_expert_param(model[0].weight) and not any(is_expert_param(p) for p in model[1].gate.parameters())
    names = expert_checkpoint_names(model)
    assert names == {f"1.local_experts.{n}": f"1.local_experts.{n}" for n in ("w1", "b1", "w2", "b2")}
    places = expert_checkpoint_places(model)  # all three experts: offset 0 of a [3, ...] stored tensor
    assert places["1.local_experts.w1"].offset == 0 and places["1.local_experts.w1"].shape == (3, F, H)
    # init_experts gives expert g the weights it gets as a module, whatever the layout
    model[1].init_experts(_init, seed=9)
    modules = MoE(H, _expert(), num_experts=3)
    modules.init_experts(_init, seed=9)
    for i in range(3):
        for a, b in zip(stacked.expert_module(i).parameters(), modules.local_experts[i].parameters()):
            assert torch.equal(a, b)
    assert not torch.equal(stacked.w1[0], stacked.w1[1])
