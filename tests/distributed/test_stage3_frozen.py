"""Frozen parameters (requires_grad=False) under stage 3: partitioned and gathered like the others, never
given gradients or optimizer state; training matches a single-process reference that freezes the same."""
import pytest
import torch
from parity import ADAM_EPS, base_config, global_batches, make_model

import zeroengine
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters, is_partitioned, safe_get_full_fp32_param, safe_get_full_grad

STEPS, WORLD = 4, 2
FROZEN = ("wpe.", "blocks.0.")  # the position embedding and the whole first block


def _frozen_model():
    model = make_model()
    for name, p in model.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    return model


def _reference():
    model = _frozen_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01,
                            eps=ADAM_EPS)
    for step in global_batches(STEPS, 1, WORLD, 2):
        x = torch.cat([x for x, _ in step[0]])
        y = torch.cat([y for _, y in step[0]])
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world):
    engine, opt, _, _ = zeroengine.initialize(model=_frozen_model(), config=base_config(2, 1, world, 0.5, stage=3))
    params = dict(engine.module.named_parameters())
    frozen = {n: p for n, p in params.items() if n.startswith(FROZEN)}
    partitioned = all(is_partitioned(p) for p in frozen.values())
    no_grads = True
    for step in global_batches(STEPS, 1, world, 2):
        x, y = step[0][rank]
        engine.backward(engine(x, y))
        no_grads &= all(p.grad is None for p in frozen.values())
        engine.step()
    state_numel = comm_sum(sum(s["exp_avg"].numel() for s in opt.optimizer.state.values()))
    live_after_step = opt.fetch_stats()["live_numel"]
    frozen_value = safe_get_full_fp32_param(params["blocks.0.mlp.fc.weight"])
    with pytest.raises(ValueError, match="frozen"):
        safe_get_full_grad(params["blocks.0.mlp.fc.weight"])
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return state, partitioned, no_grads, state_numel, live_after_step, frozen_value, \
        opt.frozen_params.layout.shard_numel, engine.memory_breakdown()["params"], opt.layout.shard_numel


def comm_sum(value: int) -> int:
    return int(zeroengine.comm.all_reduce_scalar(float(value)))


def test_partially_frozen_model_matches_the_reference_and_frozen_params_stay_untouched():
    ref = _reference()
    initial = make_model()
    trainable_numel = sum(p.numel() for n, p in initial.named_parameters() if not n.startswith(FROZEN))
    for state, partitioned, no_grads, state_numel, live, frozen_value, frozen_shard, held, shard in \
            run_distributed(_train, WORLD):
        for name, want in ref.items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        assert torch.equal(state["wpe.weight"], initial.wpe.weight.detach())
        assert torch.equal(frozen_value, initial.blocks[0].mlp.fc.weight.detach())
        assert partitioned and no_grads
        assert state_numel == trainable_numel  # optimizer state for trainable elements only, across ranks
        assert live == 0  # nothing stays gathered after a step
        assert frozen_shard > 0 and held == 4 * (shard + frozen_shard)  # frozen params are partitioned too


class _ScaledTwice(torch.nn.Module):
    """A module with a frozen parameter, called on its own output: m(m(x))."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.s = torch.nn.Parameter(torch.full((4,), 0.5), requires_grad=False)

    def forward(self, x):
        return self.lin(x) * self.s


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.m = _ScaledTwice()

    def forward(self, x):
        return self.m(self.m(x)).pow(2).mean()


def _two_sgd_steps(rank, world, model_cls, width, stage):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zeroengine.initialize(model=model_cls(), config=cfg)
    losses = []
    for i in range(2):
        loss = engine(torch.randn(2, width, generator=torch.Generator().manual_seed(i)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _assert_stage3_trains_like_stage0(model_cls, width):
    stage3 = run_distributed(_two_sgd_steps, 2, model_cls, width, 3)
    for got, want in zip(stage3, run_distributed(_two_sgd_steps, 2, model_cls, width, 0)):
        assert got == pytest.approx(want, abs=1e-7)


def test_a_frozen_parameter_of_a_module_called_on_its_own_output():
    # The outer call's backward released the frozen unit while the inner call's backward still needed it.
    _assert_stage3_trains_like_stage0(_Twice, 4)


class _AdaptedLayer(torch.nn.Module):
    """A frozen base weight with a small trainable adapter (LoRA-like)."""

    def __init__(self, d):
        super().__init__()
        self.base = torch.nn.Linear(d, d, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = torch.nn.Linear(d, 4, bias=False)
        self.b = torch.nn.Linear(4, d, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.b(self.a(x)))


def _frozen_base_peak(rank, world, mode):
    d, layers = 32, 6
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[_AdaptedLayer(d) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": d * d,
                                 "stage3_max_live_parameters": 3 * d * d, "stage3_prefetch_bucket_size": d * d}}
    engine, opt, _, _ = zeroengine.initialize(model=net, config=cfg)
    peaks = []
    for i in range(3):
        x = torch.randn(2, d, generator=torch.Generator().manual_seed(i))
        opt.reset_fetch_stats()
        if mode == "two":  # DPO-style: two forwards, one backward
            loss = 0.5 * (engine(x).pow(2).mean() + engine(2 * x).pow(2).mean())
        else:  # a forward whose output is thrown away, then the real one
            engine(3 * x)
            loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        peaks.append(opt.fetch_stats()["peak_live_numel"])
    return peaks, 3 * d * d, layers * d * d


@pytest.mark.parametrize("mode", ["two", "discard"])
def test_frozen_units_respect_max_live_with_several_forwards_per_backward(mode):
    # Counted per forward call, a frozen unit whose call never came back in backward (or had not yet) stayed
    # gathered to the end of the pass: the whole frozen model was live in the middle of backward.
    for peaks, max_live, frozen_total in run_distributed(_frozen_base_peak, 2, mode):
        assert max(peaks) <= max_live < frozen_total, (peaks, max_live)


class _LateLeafUser(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5, requires_grad=False)
        self.c = torch.nn.Linear(d, d)

    def forward(self, x, extra):
        h = torch.tanh(self.c(x) @ self.w)  # w is needed again late in backward (for c's gradient) ...
        return (h + extra) @ self.w.T  # ... after extra's gradient exists


class _LearnedQuery(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.pre = torch.nn.Linear(d, d)
        self.m = _LateLeafUser(d)
        self.query = torch.nn.Parameter(torch.zeros(d))  # a trainable leaf passed in as the module's input

    def forward(self, x):
        return self.m(self.pre(x), self.query).pow(2).mean()


def test_a_leaf_input_gradient_does_not_release_the_frozen_weight_mid_backward():
    # A leaf's gradient is accumulated as soon as it exists, before the module's backward is over: taken as
    # the end of that backward, it released the frozen weight the rest still needed.
    _assert_stage3_trains_like_stage0(_LearnedQuery, 8)
