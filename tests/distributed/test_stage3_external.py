"""Stage 3 with a parent module that uses its children's parameters directly (GPT's output projection
as ``F.linear(h, self.wte.weight)``): ``register_external_parameter`` makes the parent fetch them, before
or after ``initialize`` and under ``zero.Init``, and training matches one process."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroengine
from zeroengine.testing import run_distributed
from zeroengine.zero import (
    GatheredParameters,
    Init,
    PartitionedParameterError,
    register_external_parameter,
    unregister_external_parameter,
)

V, D = 32, 16


class Block(nn.Module):
    """Uses its sibling's weight and bias in its own forward."""

    def __init__(self, sibling: nn.Linear):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.sibling = [sibling]  # not a submodule: the weight is someone else's

    def forward(self, h):
        s = self.sibling[0]
        return torch.tanh(self.proj(h) + F.linear(h, s.weight, s.bias))


class TiedByFunction(nn.Module):
    def __init__(self, register: bool):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.side = nn.Linear(D, D)
        self.block = Block(self.side)
        self.norm = nn.LayerNorm(D)
        if register:
            register_external_parameter(self, self.wte.weight)  # the root uses it for the logits
            register_external_parameter(self.block, self.side.weight)
            register_external_parameter(self.block, self.side.bias)

    def forward(self, x, y):
        h = self.block(self.wte(x))
        h = self.side(h)  # the owner uses it too
        logits = F.linear(self.norm(h), self.wte.weight)
        return F.cross_entropy(logits.view(-1, V), y.view(-1))


def _batches(steps, world):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(V, (world * 2, 8), generator=g), torch.randint(V, (world * 2, 8), generator=g))
            for _ in range(steps)]


def _config():
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "gradient_clipping": 0,  # the reference does not clip
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}}


def _reference(steps, world):
    torch.manual_seed(0)
    model = TiedByFunction(register=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    losses = []
    for x, y in _batches(steps, world):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world, steps, when):
    torch.manual_seed(0)
    if when == "init":
        with Init():
            model = TiedByFunction(register=True)
    else:
        model = TiedByFunction(register=when == "before")
    engine, _, _, _ = zeroengine.initialize(model=model, config=_config())
    if when == "after":
        m = engine.module
        register_external_parameter(m, m.wte.weight)
        register_external_parameter(m.block, m.side.weight)
        register_external_parameter(m.block, m.side.bias)
    losses = []
    for x, y in _batches(steps, world):
        loss = engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
        engine.backward(loss)
        engine.step()
        losses.append(zeroengine.comm.all_reduce_scalar(loss.item()) / world)
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, engine.memory_breakdown()["params"], engine.optimizer.layout.shard_numel * 4


@pytest.mark.parametrize("when", ["before", "after", "init"])
def test_external_parameters_train_like_one_process(when):
    steps, world = 4, 2  # steps after the first replay the recorded order with prefetch
    ref_losses, ref_state = _reference(steps, world)
    for losses, state, held, shard_bytes in run_distributed(_train, world, steps, when):
        # the reference averages the whole global batch's loss; the ranks average their halves
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for name, want in ref_state.items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        assert held == shard_bytes  # nothing stays gathered after a step


def _unregistered(rank, world):
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=TiedByFunction(register=False), config=_config())
    x, y = _batches(1, world)[0]
    try:
        engine(x[:2], y[:2])
    except PartitionedParameterError as exc:
        return str(exc)
    return ""


def test_an_unregistered_external_use_says_how_to_register_it():
    for message in run_distributed(_unregistered, 2):
        assert "'side.weight'" in message and "register_external_parameter" in message, message


def test_register_and_unregister_check_their_arguments():
    block = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="torch.nn.Parameter"):
        register_external_parameter(block, torch.zeros(2))
    with pytest.raises(TypeError, match="nn.Module"):
        register_external_parameter(block.weight, block.weight)
    with pytest.raises(ValueError, match="not a registered external parameter"):
        unregister_external_parameter(block, block.weight)
    register_external_parameter(block, block.bias)
    unregister_external_parameter(block, block.bias)
    with pytest.raises(ValueError, match="not a registered external parameter"):
        unregister_external_parameter(block, block.bias)


def _outside_module(rank, world):
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=TiedByFunction(register=False), config=_config())
    try:
        register_external_parameter(nn.Linear(2, 2), engine.module.side.weight)
    except ValueError as exc:
        return str(exc)
    return ""


def test_registering_on_a_module_outside_the_model_is_refused():
    for message in run_distributed(_outside_module, 2):
        assert "is not a module of the model this parameter belongs to" in message, message
