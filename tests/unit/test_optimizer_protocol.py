"""What torch.optim.Optimizer's protocol asks of our optimizers (zeroengine/ops/optimizer_protocol.py holds the
rules they share).

``step(closure)`` as torch's optimizers take it: the step runs under no_grad, the closure with grad enabled (it
calls backward), and the step returns the closure's loss. Every optimizer of ours that takes a closure: the C++
CPUAdam and its torch fallback, LeanAdam (bf16 masters) and the partition-aware Adafactor and SM3.

``load_state_dict``: moments come back in the dtype they are kept in, not cast to the parameter's (torch's
base class would round a bf16 parameter's fp32 moments to bf16)."""
import copy

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


@pytest.mark.parametrize("cls", [LeanAdam, CPUAdam])
def test_fp32_moments_of_a_bf16_param_reload_exactly(cls):
    torch.manual_seed(0)
    first = torch.nn.Parameter(torch.randn(300).bfloat16())
    second = torch.nn.Parameter(first.detach().clone())
    saving = cls([first], lr=1e-2, state_dtype=torch.float32)
    grads = [(torch.randn(300) * 1e-2).bfloat16() for _ in range(3)]
    first.grad = grads[0]
    saving.step()
    loading = cls([second], lr=1e-2, state_dtype=torch.float32)
    second.data.copy_(first.detach())
    # (a copy, as a checkpoint file gives: a live state dict shares its step tensors, as torch's does)
    loading.load_state_dict(copy.deepcopy(saving.state_dict()))
    for key in ("exp_avg", "exp_avg_sq"):
        kept = loading.state[second][key]
        assert kept.dtype == torch.float32 and torch.equal(kept, saving.state[first][key])  # not rounded to bf16
    for grad in grads[1:]:  # and the two go on as one
        first.grad, second.grad = grad.clone(), grad.clone()
        saving.step()
        loading.step()
    assert torch.equal(first, second)


def test_lean_adam_without_a_state_dtype_follows_the_param_as_torch():
    p = torch.nn.Parameter(torch.randn(8).bfloat16())
    p.grad = torch.ones_like(p)
    saving = LeanAdam([p])
    saving.step()
    loading = LeanAdam([torch.nn.Parameter(p.detach().clone())])
    loading.load_state_dict(saving.state_dict())
    assert {t.dtype for state in loading.state.values() for k, t in state.items() if k != "step"} == {torch.bfloat16}
