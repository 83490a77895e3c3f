"""``optimizer.step(closure)`` as torch's optimizers take it: the step runs under no_grad, the closure with grad
enabled (it calls backward), and the step returns the closure's loss. Every optimizer of ours that takes a
closure: the C++ CPUAdam and its torch fallback, LeanAdam (bf16 masters) and the partition-aware Adafactor
and SM3 (zeroengine/ops/closure.py holds the one rule they share)."""
import pytest
import torch

from zeroengine.ops.adam import CPUAdam
from zeroengine.optim.adafactor import Adafactor
from zeroengine.optim.lean_adam import LeanAdam
from zeroengine.optim.sm3 import SM3

BUILDERS = {
    "cpu_adam": lambda params: CPUAdam(params, lr=1e-2),
    "cpu_adam_torch": lambda params: CPUAdam(params, lr=1e-2, impl="torch"),
    "lean_adam": lambda params: LeanAdam(params, lr=1e-2),
    "adafactor": lambda params: Adafactor(params, lr=1e-2),
    "sm3": lambda params: SM3(params, lr=1e-2),
}


def model_and_batch(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    return model, torch.randn(8, 6), torch.randn(8, 1)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_step_runs_the_closure_with_grad_and_returns_its_loss(name):
    model, x, y = model_and_batch()
    optimizer = BUILDERS[name](model.parameters())
    calls = []

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # fails if the closure ran under the step's no_grad
        calls.append(loss.detach())
        return loss

    with torch.no_grad():  # a caller's no_grad does not reach the closure either, as in torch
        returned = optimizer.step(closure)
    assert len(calls) == 1 and torch.equal(returned.detach(), calls[0])

    twin, x, y = model_and_batch()
    twin_optimizer = BUILDERS[name](twin.parameters())
    torch.nn.functional.mse_loss(twin(x), y).backward()
    assert twin_optimizer.step() is None
    initial = model_and_batch()[0]
    for stepped, reference, before in zip(model.parameters(), twin.parameters(), initial.parameters()):
        assert not torch.equal(stepped, before)  # the closure's gradients were stepped
        torch.testing.assert_close(stepped, reference, rtol=0, atol=0)
