"""Gates: capacity maths, dropped-token accounting, the auxiliary losses against hand-computed values,
noise and random routing determinism, fp32 routing under bf16."""
import math

import pytest
import torch

from zeroengine.moe import GateOutput, TopKGate, capacity_for


def _gate(weight, **kw):
    gate = TopKGate(weight.shape[1], weight.shape[0], **kw)
    with torch.no_grad():
        gate.wg.weight.copy_(weight)
    return gate


def test_capacity_maths():
    assert capacity_for(10, 4, 1, 1.0, 0) == 3  # ceil(2.5)
    assert capacity_for(10, 4, 1, 1.0, 4) == 4  # min_capacity wins
    assert capacity_for(10, 4, 2, 1.25, 0) == 7  # ceil(2 * 2.5 * 1.25) = ceil(6.25)
    assert capacity_for(4096, 64, 2, 1.0, 4) == 128
    # exact arithmetic on the factor: in floats 100 * 1.1 / 2 = 55.000000000000007 would give 56
    assert capacity_for(100, 2, 1, 1.1, 0) == 55 and capacity_for(50, 2, 2, 1.1, 0) == 55
    gate = TopKGate(8, 4, k=1, capacity_factor=2.0, eval_capacity_factor=0.5, min_capacity=1)
    assert gate.capacity(16) == 8
    gate.eval()
    assert gate.capacity(16) == 2
    assert TopKGate(8, 4, drop_tokens=False).capacity(16) is None


def test_dropped_token_accounting_top1():
    # Every token prefers expert 0: capacity 3 keeps tokens 0..2 and drops the other 7.
    gate = _gate(torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]), k=1, min_capacity=0)
    x = torch.cat([torch.ones(10, 1) * torch.linspace(1, 2, 10).unsqueeze(1), torch.zeros(10, 1)], 1)
    out = gate(x)
    assert out.capacity == 3
    assert out.exp_counts.tolist() == [10, 0, 0, 0] and out.kept_counts.tolist() == [3, 0, 0, 0]
    assert out.kept[:, 0].tolist() == [True] * 3 + [False] * 7
    assert out.num_dropped == 7
    assert torch.all(out.weights[3:] == 0) and torch.all(out.weights[:3] > 0)


def test_top2_drops_second_choices_before_first_choices():
    # 4 tokens, 2 experts, k=2: every token routes to both; first choices: tokens 0,1 -> e0, tokens 2,3 -> e1.
    gate = _gate(torch.tensor([[1.0], [-1.0]]), k=2, capacity_factor=0.5, min_capacity=0)
    x = torch.tensor([[2.0], [1.0], [-1.0], [-2.0]])
    out = gate(x)
    assert out.capacity == 2  # ceil(2 * 4 / 2 * 0.5)
    assert out.expert_index[:, 0].tolist() == [0, 0, 1, 1]
    assert out.kept[:, 0].all() and not out.kept[:, 1].any()  # all capacity goes to first choices
    assert out.num_dropped == 4 and out.exp_counts.tolist() == [4, 4]
    # renormalised over what was kept: every token's whole weight on its first choice
    torch.testing.assert_close(out.weights[:, 0], torch.ones(4))


def test_dropless_keeps_everything():
    torch.manual_seed(0)
    gate = TopKGate(6, 5, k=2, drop_tokens=False)
    out = gate(torch.randn(50, 6))
    assert out.capacity is None and out.kept.all() and out.num_dropped == 0
    assert int(out.exp_counts.sum()) == 100 and torch.equal(out.exp_counts, out.kept_counts)
    torch.testing.assert_close(out.weights.sum(1), torch.ones(50))


def test_aux_loss_against_hand_computation():
    gate = _gate(torch.eye(2), k=1)  # logits = x
    rows = [[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [3.0, 0.0]]
    out = gate(torch.tensor(rows))
    probs = [[math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))] for a, b in rows]
    f = [3 / 4, 1 / 4]  # first choices: e0, e1, e0, e0
    p_mean = [sum(p[i] for p in probs) / 4 for i in range(2)]
    expected = 2 * (f[0] * p_mean[0] + f[1] * p_mean[1])
    assert out.l_aux.item() == pytest.approx(expected, rel=1e-6)
    # top-1 combine weight is the chosen expert's probability
    torch.testing.assert_close(out.weights[:, 0], torch.tensor([max(p) for p in probs]))


def test_z_loss_against_hand_computation():
    rows = [[2.0, 0.0], [0.0, 1.0]]
    plain = _gate(torch.eye(2), k=1)(torch.tensor(rows)).l_aux.item()
    with_z = _gate(torch.eye(2), k=1, z_loss_coef=0.1)(torch.tensor(rows)).l_aux.item()
    z = sum(math.log(math.exp(a) + math.exp(b)) ** 2 for a, b in rows) / 2
    assert with_z - plain == pytest.approx(0.1 * z, rel=1e-5)


@pytest.mark.parametrize("kw", [dict(noisy_gate_policy="Jitter"), dict(noisy_gate_policy="RSample"),
                                dict(k=2, second_expert_policy="random"), dict(k=2, second_expert_policy="sample"),
                                dict(k=1, use_rts=True, capacity_factor=0.5)])
def test_noisy_routing_is_deterministic_under_a_seed(kw):
    torch.manual_seed(0)
    gate = TopKGate(16, 8, min_capacity=0, **kw)
    # near-ties, so noise changes choices; clear preferences, so 2 * g2 < 1 and random routing matters
    x = torch.randn(256, 16) * (3.0 if "second_expert_policy" in kw or "use_rts" in kw else 0.01)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        out = gate(x)
        runs.append((out.expert_index, out.kept, out.weights))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(runs[0], runs[2]))
    gate.eval()  # no noise in eval: seeds do not matter
    torch.manual_seed(1)
    first = gate(x)
    torch.manual_seed(2)
    second = gate(x)
    assert torch.equal(first.expert_index, second.expert_index) and torch.equal(first.kept, second.kept)


def test_gshard_random_routing_dispatches_second_choice_with_probability_2_g2():
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=2, drop_tokens=False, second_expert_policy="random")
    x = torch.randn(20000, 8)
    out = gate(x)
    probs = torch.softmax(x @ gate.wg.weight.detach().t(), -1).gather(1, out.expert_index)
    expected = torch.clamp(2 * probs[:, 1] / probs.sum(1), max=1).mean().item()
    assert out.routed[:, 0].all()
    assert out.routed[:, 1].float().mean().item() == pytest.approx(expected, abs=0.01)
    # a token without a second expert puts its whole weight on the first
    alone = ~out.routed[:, 1]
    torch.testing.assert_close(out.weights[alone, 0], torch.ones(int(alone.sum())))


def _all_prefer_expert_0(tokens):
    """A 4-expert top-1 gate every one of ``tokens`` tokens sends to expert 0 (logits 1 vs 0)."""
    gate = _gate(torch.tensor([[1.0], [0.0], [0.0], [0.0]]), k=1, min_capacity=0)
    return gate, torch.ones(tokens, 1)


def test_random_token_selection_keeps_a_uniform_random_subset():
    """use_rts (DeepSpeed's default for top-1): an overflowing expert keeps `capacity` tokens chosen at
    random, every position equally likely, instead of the first ones; still exactly `capacity` of them."""
    tokens, trials = 100, 200
    gate, x = _all_prefer_expert_0(tokens)
    gate.capacity_factor = 1.2
    assert gate.capacity(tokens) == 30
    plain = gate(x)
    assert plain.kept[:, 0].tolist() == [True] * 30 + [False] * 70  # token order without RTS
    gate.use_rts = True
    torch.manual_seed(0)
    kept = torch.stack([gate(x).kept[:, 0] for _ in range(trials)]).float()  # [trials, tokens]
    assert torch.all(kept.sum(1) == 30)
    per_block = kept.view(trials, 10, 10).mean((0, 2))  # positions 0-9, 10-19, ...: each kept 30% of the time
    assert torch.all((per_block - 0.3).abs() < 0.05), per_block  # ~5 standard deviations
    assert torch.all((kept.mean(0) - 0.3).abs() < 0.17)  # every single token too (~5 sd)
    assert len({tuple(row.tolist()) for row in kept}) == trials  # a different subset every time


def test_random_token_selection_keeps_everything_that_fits_and_is_off_in_eval():
    gate, x = _all_prefer_expert_0(10)
    gate.use_rts, gate.capacity_factor = True, 4.0  # capacity 10: nothing overflows
    assert gate(x).kept.all()
    gate.capacity_factor = 1.0
    gate.eval()  # evaluation stays deterministic (DeepSpeed draws there too) and draws no random numbers
    state = torch.get_rng_state()
    assert gate(x).kept[:, 0].tolist() == [True] * 3 + [False] * 7
    assert torch.equal(state, torch.get_rng_state())


def test_random_token_selection_is_top1_only():
    """As in DeepSpeed, top-2 keeps GShard's order: all first choices (token order) before second ones."""
    gate = _gate(torch.tensor([[1.0], [-1.0]]), k=2, capacity_factor=0.5, min_capacity=0, use_rts=True)
    x = torch.tensor([[2.0], [1.0], [-1.0], [-2.0]])
    state = torch.get_rng_state()
    out = gate(x)
    assert out.kept[:, 0].all() and not out.kept[:, 1].any()
    assert torch.equal(state, torch.get_rng_state())


def test_priority_orders_each_choice_rank_in_from_choices():
    # expert 0, capacity 2: first choices of tokens 0-3, served by descending priority
    idx = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    priority = torch.tensor([[0.1, 0.0], [0.9, 0.0], [0.5, 0.0], [0.7, 0.0]])
    out = GateOutput.from_choices(idx, torch.ones(4, 2), num_experts=2, capacity=2, priority=priority)
    assert out.kept[:, 0].tolist() == [False, True, False, True]
    assert out.kept[:, 1].tolist() == [True, True, False, False]  # second choices keep token order (equal priority)


def test_sampled_second_expert_follows_the_softmax_of_the_rest():
    """second_expert_policy="sample" (DeepSpeed's top2_2nd_expert_sampling): the first choice is the top
    expert, the second is drawn from softmax(logits) over the other experts; in eval it is the top-2."""
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0])
    gate = _gate(logits.unsqueeze(1), k=2, drop_tokens=False, second_expert_policy="sample")
    x = torch.ones(20000, 1)  # every token has these logits
    torch.manual_seed(0)
    out = gate(x)
    assert torch.all(out.expert_index[:, 0] == 0)
    drawn = torch.bincount(out.expert_index[:, 1], minlength=4).float() / x.shape[0]
    expected = torch.cat([torch.zeros(1), torch.softmax(logits[1:], 0)])  # [0, .665, .245, .090]
    torch.testing.assert_close(drawn, expected, atol=0.015, rtol=0)
    probs = torch.softmax(logits, 0)
    second = out.expert_index[:, 1]
    torch.testing.assert_close(out.weights[:, 1], probs[second] / (probs[0] + probs[second]))
    gate.eval()
    assert torch.all(gate(x).expert_index == torch.tensor([0, 1]))


def test_deepspeed_none_string_means_no_noise():
    assert TopKGate(4, 4, noisy_gate_policy="None").noisy_gate_policy is None


def test_router_runs_in_fp32_under_bf16():
    torch.manual_seed(0)
    gate = TopKGate(16, 8, k=2).to(torch.bfloat16)
    x = torch.randn(64, 16, dtype=torch.bfloat16)
    out = gate(x)
    assert out.weights.dtype == torch.float32 and out.l_aux.dtype == torch.float32
    logits = x.float() @ gate.wg.weight.float().t()
    assert torch.equal(out.expert_index, torch.topk(logits, 2).indices)
    out.l_aux.backward()
    assert gate.wg.weight.grad.dtype == torch.bfloat16


def test_from_choices_for_custom_routers():
    idx = torch.tensor([[0], [0], [1], [0]])
    out = GateOutput.from_choices(idx, torch.ones(4, 1), num_experts=2, capacity=2)
    assert out.kept[:, 0].tolist() == [True, True, True, False] and out.kept_counts.tolist() == [2, 1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(4, 4, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k"):
        TopKGate(4, 2, k=3)
