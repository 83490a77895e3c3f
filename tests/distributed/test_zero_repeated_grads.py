"""A parameter accumulated more than once in one backward: each segment of reentrant activation
checkpointing runs a backward of its own, so a layer applied in several checkpointed segments, or a tied
embedding/head whose head is checkpointed, gets one accumulation (and one gradient hook) per segment.
Every stage must give the single-process gradient (see zeroengine/zero/grad_stores.py, "Note: a gradient
accumulated more than once"); before, stages 1-3 launched the bucket at the first contribution and lost
or double-counted the others."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroengine
from zeroengine import checkpointing
from zeroengine.testing import run_distributed

V, D, WORLD, MICRO = 16, 8, 2, 3


class SharedAndTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layer = nn.Linear(D, D)  # applied in three checkpointed segments
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied, and the head runs checkpointed

    def forward(self, x, y):
        h = self.emb(x)
        for _ in range(3):
            h = checkpointing.checkpoint(lambda t: torch.tanh(self.layer(t)), h)
        return checkpointing.checkpoint(lambda t: F.cross_entropy(self.head(t).view(-1, V), y.view(-1)), h)


def _model():
    torch.manual_seed(0)
    return SharedAndTied()


def _batch(rank):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randint(V, (WORLD * MICRO, 5), generator=g), torch.randint(V, (WORLD * MICRO, 5), generator=g)
    return x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def _engine_step(rank, world, stage):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 64,
                                    "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=config)
    engine.backward(engine(*_batch(rank)))
    engine.step()
    from zeroengine.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        return engine.get_global_grad_norm(), {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_sums_all_contributions_of_a_shared_and_a_tied_weight(stage):
    model = _model()
    loss = sum(model(*_batch(r)) for r in range(WORLD)) / WORLD
    loss.backward()
    norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    for got_norm, state in run_distributed(_engine_step, WORLD, stage):
        assert got_norm == pytest.approx(norm, rel=1e-5)
        for name, want in model.state_dict().items():
            torch.testing.assert_close(state[name], want, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def _double_backward_stage1(rank, world):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_optimization": {"stage": 1}}
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=config)
    engine.backward(engine(*_batch(rank)))
    try:
        engine.backward(engine(*_batch(rank)))
    except RuntimeError as err:
        return str(err)
    return ""


def test_a_second_backward_on_a_stage1_boundary_is_refused_instead_of_corrupting_the_gradient():
    for message in run_distributed(_double_backward_stage1, WORLD):
        assert "ZeRO stage 1: a second backward() on the accumulation-boundary micro-step" in message
