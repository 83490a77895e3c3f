"""The MoE layer on one rank against a token-by-token reference; residual MoE, custom gates,
expert tags and checkpoint names."""
import pytest
import torch
import torch.nn as nn

from zeroengine.moe import GateOutput, MoE, expert_checkpoint_names, expert_tag, is_expert_param

H = 8


def _expert():
    return nn.Sequential(nn.Linear(H, 16), nn.GELU(), nn.Linear(16, H))


def _init(expert):
    for p in expert.parameters():
        nn.init.normal_(p, std=0.3)


def _token_by_token(moe, x):
    """out[t] = sum over kept choices j of w[t, j] * expert_{e[t, j]}(x[t]), one token at a time."""
    routing = moe.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.k):
            if routing.kept[t, j]:
                e = int(routing.expert_index[t, j])
                out[t] += routing.weights[t, j] * moe.local_experts[e](x[t:t + 1])[0]
    return out, routing


@pytest.mark.parametrize("k,drop_tokens,impl", [(1, True, "auto"), (2, True, "auto"), (2, False, "auto"),
                                                 (2, True, "torch")])
def test_matches_token_by_token_reference(k, drop_tokens, impl):
    torch.manual_seed(0)
    moe = MoE(H, _expert(), num_experts=4, k=k, capacity_factor=0.75, min_capacity=1, drop_tokens=drop_tokens,
              impl=impl)
    moe.init_experts(_init, seed=3)
    x = torch.randn(2, 15, H)
    out, l_aux, counts = moe(x)
    ref, routing = _token_by_token(moe, x.reshape(-1, H))
    torch.testing.assert_close(out.reshape(-1, H), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, routing.exp_counts) and int(counts.sum()) == 30 * k
    assert (routing.num_dropped > 0) == drop_tokens  # capacity 0.75 overflows somewhere
    torch.testing.assert_close(l_aux, routing.l_aux)


def test_gradients_match_token_by_token_reference():
    torch.manual_seed(0)
    moe = MoE(H, _expert(), num_experts=3, k=2, drop_tokens=False)
    moe.init_experts(_init, seed=1)
    x = torch.randn(12, H, requires_grad=True)
    out, l_aux, _ = moe(x)
    (out.pow(2).sum() + l_aux).backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    x.grad = None
    ref, routing = _token_by_token(moe, x)
    (ref.pow(2).sum() + routing.l_aux).backward()
    for got, want in zip(grads, [x.grad] + [p.grad for p in moe.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_residual_moe_mixes_a_dense_mlp():
    torch.manual_seed(0)
    moe = MoE(H, _expert(), num_experts=2, k=1, drop_tokens=False, use_residual=True)
    x = torch.randn(5, H)
    out, _, _ = moe(x)
    coef = torch.softmax(moe.coefficient(x), -1)
    ref, _ = _token_by_token(moe, x)
    torch.testing.assert_close(out, ref * coef[:, :1] + moe.mlp(x) * coef[:, 1:], rtol=1e-5, atol=1e-6)
    assert not any(is_expert_param(p) for p in moe.mlp.parameters())


class _WithBias(nn.Module):
    """A Megatron-style expert: returns (output, bias)."""

    def __init__(self):
        super().__init__()
        self.mlp = _expert()

    def forward(self, x):
        return self.mlp(x), torch.ones(H)


@pytest.mark.parametrize("num_experts", [1, 4])
@pytest.mark.parametrize("serial", [False, True])
def test_experts_returning_output_and_bias_use_the_output_as_deepspeed(num_experts, serial):
    torch.manual_seed(0)
    moe = MoE(H, _WithBias(), num_experts=num_experts, k=1, drop_tokens=False, use_residual=True)
    if serial:
        moe.local_experts.serial_below = 1 << 30  # the one-thread group path (expert_group.py)
    x = torch.randn(8192, H, requires_grad=True)  # batches over PARALLEL_FROM elements: the group path runs
    out, _, _ = moe(x)
    plain = MoE(H, _expert(), num_experts=num_experts, k=1, drop_tokens=False, use_residual=True)
    for e_plain, e in zip(plain.local_experts, moe.local_experts):
        e_plain.load_state_dict(e.mlp.state_dict())
    plain.mlp.load_state_dict(moe.mlp.mlp.state_dict())
    plain.gate.load_state_dict(moe.gate.state_dict())
    plain.coefficient.load_state_dict(moe.coefficient.state_dict())
    torch.testing.assert_close(out, plain(x)[0])
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in moe.local_experts.parameters())


def test_deepspeeds_used_token_is_refused_by_name():
    moe = MoE(H, _expert(), num_experts=2)
    with pytest.raises(NotImplementedError, match="used_token"):
        moe(torch.randn(4, H), torch.ones(4))


class _FirstExpertRouter(nn.Module):
    """A custom router: every token to expert 0 with weight 1."""

    def forward(self, x):
        idx = torch.zeros(x.shape[0], 1, dtype=torch.long)
        return GateOutput.from_choices(idx, torch.ones(x.shape[0], 1), num_experts=3)


def test_custom_gate_is_pluggable():
    torch.manual_seed(0)
    moe = MoE(H, _expert(), num_experts=3, gate=_FirstExpertRouter())
    moe.init_experts(_init, seed=0)
    x = torch.randn(4, H)
    out, _, counts = moe(x)
    torch.testing.assert_close(out, moe.local_experts[0](x))
    assert counts.tolist() == [4, 0, 0]


def test_expert_tags_and_checkpoint_names():
    model = nn.Sequential(nn.Linear(H, H), MoE(H, _expert(), num_experts=2))
    tagged = [n for n, p in model.named_parameters() if is_expert_param(p)]
    assert tagged and all(".local_experts." in n for n in tagged)
    assert expert_tag(model[1].local_experts[1][0].weight).expert_id == 1
    names = expert_checkpoint_names(model)
    assert sorted(names) == sorted(tagged) and all(k == v for k, v in names.items())  # one rank: ids are local


def test_init_experts_gives_distinct_reproducible_experts():
    a = MoE(H, _expert(), num_experts=2)
    b = MoE(H, _expert(), num_experts=2)
    a.init_experts(_init, seed=7)
    b.init_experts(_init, seed=7)
    wa = [e[0].weight for e in a.local_experts]
    assert not torch.equal(wa[0], wa[1]) and torch.equal(wa[1], b.local_experts[1][0].weight)


# -- DeepSpeed's MoE keywords --------------------------------------------------------------------

def test_deepspeed_keywords_are_accepted_by_keyword():
    moe = MoE(hidden_size=H, expert=_expert(), num_experts=4, ep_size=1, k=2, capacity_factor=1.0,
              eval_capacity_factor=1.0, min_capacity=4, use_residual=False, noisy_gate_policy=None,
              drop_tokens=True, use_rts=True, use_tutel=True, enable_expert_tensor_parallelism=False,
              top2_2nd_expert_sampling=True)
    assert moe.gate.use_rts and moe.gate.second_expert_policy == "sample" and moe.use_tutel
    out, _, _ = moe(torch.randn(6, H))
    assert out.shape == (6, H)
    plain = MoE(H, _expert(), num_experts=4, k=2)  # zeroengine's defaults: deterministic routing
    assert not plain.gate.use_rts and plain.gate.second_expert_policy == "all"
    assert MoE(H, _expert(), num_experts=4, k=2, top2_2nd_expert_sampling=False).gate.second_expert_policy == "all"


def test_expert_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="no tensor parallelism"):
        MoE(H, _expert(), num_experts=2, enable_expert_tensor_parallelism=True)


@pytest.mark.parametrize("tail", [(False,), (False, None), (True, "Jitter", True), (False, None, True)])
def test_deepspeed_positional_order_is_caught(tail):
    """DeepSpeed: (..., min_capacity, use_residual, noisy_gate_policy, drop_tokens)."""
    with pytest.raises(TypeError, match="by keyword"):
        MoE(H, _expert(), 2, 1, 1, 1.0, 1.0, 4, *tail)


def test_contradicting_second_expert_settings_are_refused():
    with pytest.raises(ValueError, match="contradicts"):
        MoE(H, _expert(), num_experts=2, k=2, top2_2nd_expert_sampling=True, second_expert_policy="all")


def test_use_rts_with_top2_changes_nothing_as_in_deepspeed():
    torch.manual_seed(0)
    a = MoE(H, _expert(), num_experts=2, k=2, capacity_factor=0.5, min_capacity=1, use_rts=True)
    b = MoE(H, _expert(), num_experts=2, k=2, capacity_factor=0.5, min_capacity=1)
    b.load_state_dict(a.state_dict())
    x = torch.randn(12, H)
    state = torch.get_rng_state()
    torch.testing.assert_close(a(x)[0], b(x)[0])
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("kw", [dict(k=1, use_rts=True), dict(k=2, top2_2nd_expert_sampling=True)])
def test_random_routing_layers_match_token_by_token_reference(kw):
    """The layer dispatches whatever the random routing chose (the reference replays it under the same seed)."""
    torch.manual_seed(0)
    moe = MoE(H, _expert(), num_experts=4, capacity_factor=0.75, min_capacity=1, **kw)
    moe.init_experts(_init, seed=3)
    x = torch.randn(30, H)
    torch.manual_seed(11)
    out, _, _ = moe(x)
    torch.manual_seed(11)
    ref, routing = _token_by_token(moe, x)
    assert routing.num_dropped > 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.manual_seed(12)
    assert not torch.equal(moe.gate(x).kept, routing.kept) or not torch.equal(
        moe.gate(x).expert_index, routing.expert_index)
