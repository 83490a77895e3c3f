"""Activation checkpointing: gradients with recompute equal those without, whatever is passed through it."""
import itertools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from model import GPT, Block, GPTConfig

import zeroengine
from zeroengine import checkpointing
from zeroengine.config import ConfigError

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.2)


@pytest.fixture(autouse=True)
def _fresh_settings():
    checkpointing.reset()
    checkpointing.reset_profile()
    yield
    checkpointing.reset()
    checkpointing.reset_profile()


def _gpt(wrap: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    if wrap:
        checkpointing.checkpoint_modules(model, Block)
    return model


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(CFG.vocab_size, (2, CFG.block_size), generator=g),
            torch.randint(CFG.vocab_size, (2, CFG.block_size), generator=g))


def _grads_and_loss(model, steps=2):
    """Two forward/backward passes (dropout on) accumulating into .grad; the RNG draw right after."""
    torch.manual_seed(123)
    losses = []
    for s in range(steps):
        loss = model(*_batch(s))
        loss.backward()
        losses.append(loss.item())
    return {n: p.grad.clone() for n, p in model.named_parameters()}, losses, torch.rand(3)


def _assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


# Every combination configure() accepts (contiguous packing needs partitioning, as in DeepSpeed). Without a
# model-parallel group partitioning keeps inputs whole; tests/distributed covers a real 2-rank group.
_GRID = [c for c in itertools.product([False, True], repeat=5) if not (c[2] and not c[0])]


@pytest.mark.parametrize("partition,cpu,contiguous,sync,profile", _GRID)
def test_gradients_match_for_every_option_combination(partition, cpu, contiguous, sync, profile):
    reference, ref_losses, ref_next = _grads_and_loss(_gpt(wrap=False))
    checkpointing.configure(None, partition_activations=partition, checkpoint_in_cpu=cpu,
                            contiguous_checkpointing=contiguous, num_checkpoints=CFG.n_layer if contiguous else None,
                            synchronize=sync, profile=profile)
    grads, losses, next_draw = _grads_and_loss(_gpt(wrap=True))
    _assert_same_grads(grads, reference)
    assert losses == ref_losses
    # the recompute replayed the dropout RNG and then put it back where the plain run left it
    assert torch.equal(next_draw, ref_next)
    report = checkpointing.profile_report()
    if profile:
        assert set(report) == {f"blocks.{i}" for i in range(CFG.n_layer)}
        assert all(r["forward_calls"] == 2 and r["recompute_calls"] == 2 and r["recompute_s"] > 0
                   for r in report.values())
    else:
        assert report == {}


def _reference_and_checkpointed(function, *args):
    """(outputs, grads of every leaf that requires grad) for a plain call and a checkpointed one."""
    def run(call):
        torch.manual_seed(7)
        out = call(function, *args)
        tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        sum(t.float().sum() * (i + 1) for i, t in enumerate(tensors)).backward()
        leaves = [t for t in _leaves(function, args) if t.requires_grad]
        grads = [t.grad.clone() if t.grad is not None else None for t in leaves]
        for t in leaves:
            t.grad = None
        return out, grads

    return run(lambda f, *a: f(*a)), run(checkpointing.checkpoint)


def _leaves(function, args):
    params = list(function.parameters()) if isinstance(function, nn.Module) else []
    return params + [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]


class Odd(nn.Module):
    """Takes tensors nested in containers and plain values; returns a tuple with non-tensors and a dict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, scale, pair, flag, mask=None):
        h = self.drop(torch.tanh(self.lin(x))) * scale
        if flag:
            h = h + pair[0] * pair[1]
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return h, h.argmax(-1), "tag", {"mean": h.mean(), "count": 3}


def test_non_tensor_arguments_nested_tensors_and_tuple_outputs():
    torch.manual_seed(0)
    module = Odd()
    x = torch.randn(4, 8, requires_grad=True)
    a = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(8)  # does not require grad
    mask = torch.rand(4, 8) > 0.7
    (ref_out, ref_grads), (out, grads) = _reference_and_checkpointed(module, x, 0.5, (a, b), True, mask)
    assert out[2] == "tag" and out[3]["count"] == 3
    assert out[1].dtype == torch.long and not out[1].requires_grad and torch.equal(out[1], ref_out[1])
    torch.testing.assert_close(out[0], ref_out[0], atol=0, rtol=0)
    assert len(grads) == len(ref_grads) == 4  # lin.weight, lin.bias, x, a
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)


def test_inputs_that_do_not_require_grad_still_give_parameter_gradients():
    torch.manual_seed(0)
    block = Block(CFG)
    x = torch.randn(2, CFG.block_size, CFG.n_embd)  # e.g. a frozen embedding's output
    (ref_out, ref_grads), (out, grads) = _reference_and_checkpointed(block, x)
    assert out.requires_grad and len(grads) == len(list(block.parameters()))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Block(CFG), Block(CFG)

    def forward(self, x):
        # inner checkpoints inside an outer one: the outer recompute creates (and backpropagates) inner ones
        return checkpointing.checkpoint(self.second, checkpointing.checkpoint(self.first, x))


def test_nested_checkpoints():
    torch.manual_seed(0)
    pair = TwoBlocks()
    x = torch.randn(2, CFG.block_size, CFG.n_embd, requires_grad=True)

    def plain(f, *a):
        return f.second(f.first(*a))

    torch.manual_seed(7)
    ref = plain(pair, x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in pair.parameters()] + [x.grad.clone()]
    pair.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(7)
    out = checkpointing.checkpoint(pair, x)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    out.sum().backward()
    for g, r in zip([p.grad for p in pair.parameters()] + [x.grad], ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)


def test_model_parallel_rng_tracker_is_replayed():
    checkpointing.model_parallel_cuda_manual_seed(1234)
    tracker = checkpointing.get_cuda_rng_tracker()

    def segment(x):
        with tracker.fork():  # tensor-parallel dropout draws from the tracker's state
            x = F.dropout(x, 0.5)
        return F.dropout(x * 2, 0.5)

    x = torch.randn(64, requires_grad=True)
    states = tracker.get_states()
    torch.manual_seed(3)
    segment(x).pow(2).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    tracker.set_states(states)
    torch.manual_seed(3)
    checkpointing.checkpoint(segment, x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 1)


def test_autocast_state_is_replayed():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lin(x)
    ref.float().sum().backward()
    ref_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = checkpointing.checkpoint(lin, x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # outside autocast: the recompute must still run in bf16
    torch.testing.assert_close(lin.weight.grad, ref_grad, atol=0, rtol=0)


def test_an_autocast_around_backward_only_stays_out_of_the_recompute():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))  # the recomputed tanh feeds a gradient
    x = torch.randn(4, 8, requires_grad=True)
    loss = lin(x).pow(2).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (on CPU it reaches the backward's own matmuls)
        loss.backward()
    ref_grad = lin[2].weight.grad.clone()
    lin.zero_grad(set_to_none=True)
    loss = checkpointing.checkpoint(lin, x).pow(2).sum()  # forward in fp32 ...
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss.backward()  # ... so the recompute is fp32 too, as the plain forward was
    torch.testing.assert_close(lin[2].weight.grad, ref_grad, atol=0, rtol=0)


def test_stashed_inputs_are_freed_after_backward_and_the_arena_does_not_grow():
    # Before, the lease went back only when the node died: in a usual loop the previous loss keeps it alive,
    # so every step took a new slot and the contiguous buffer doubled again and again.
    from zeroengine.activation_checkpointing.storage import arenas

    checkpointing.configure(partition_activations=True, cpu_checkpointing=True, contiguous_memory_optimization=True,
                            number_checkpoints=1)
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    sizes, loss = [], None
    for _ in range(6):
        loss = checkpointing.checkpoint(lin, torch.randn(4, 8, requires_grad=True)).sum()  # the old loss lives on
        loss.backward()
        sizes.append(sum(a.buffer.numel() for a in arenas().values() if a.buffer is not None))
    assert len(set(sizes)) == 1, sizes
    out = checkpointing.checkpoint(lin, torch.randn(4, 8, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True needs these options off"):
        out.backward()


def test_no_grad_is_a_plain_call_and_autograd_grad_is_refused():
    block = Block(CFG)
    x = torch.randn(1, 4, CFG.n_embd, requires_grad=True)
    with torch.no_grad():
        assert checkpointing.checkpoint(block, x).grad_fn is None
    out = checkpointing.checkpoint(block, x)
    with pytest.raises(RuntimeError, match="not torch.autograd.grad"):
        torch.autograd.grad(out.sum(), x)


@pytest.mark.parametrize("cpu", [False, True])
def test_an_input_changed_in_place_before_backward_is_an_error_in_every_mode(cpu):
    # on CPU, cpu_checkpointing keeps the input itself (no copy): its change would go into the recompute
    checkpointing.configure(cpu_checkpointing=cpu)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    y = checkpointing.checkpoint(lin, x)
    x.mul_(100)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    x2 = torch.randn(3, 4)
    checkpointing.checkpoint(lin, x2).sum().backward()  # untouched inputs: fine
    assert lin.weight.grad is not None


def test_checkpoint_modules_keeps_the_model_the_same_model():
    model = _gpt(wrap=False)
    keys = list(model.state_dict())
    names = checkpointing.checkpoint_modules(model, "Block")
    assert names == [f"blocks.{i}" for i in range(CFG.n_layer)]
    assert list(model.state_dict()) == keys
    assert all(isinstance(b, Block) and type(b) is not Block for b in model.blocks)
    assert checkpointing.checkpoint_modules(model, Block) == names  # twice is harmless
    out = model.blocks[0](torch.randn(1, 4, CFG.n_embd))
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"
    assert checkpointing.uncheckpoint_modules(model) == names
    assert all(type(b) is Block for b in model.blocks)
    with pytest.raises(ValueError, match="no module"):
        checkpointing.checkpoint_modules(model, nn.GRU)


def test_configure_accepts_both_spellings_and_the_config_section(tmp_path):
    s = checkpointing.configure(None, None, True, True, 4, True, True, True)  # DeepSpeed's positional order
    assert (s.partition_activations, s.contiguous_memory_optimization, s.number_checkpoints, s.cpu_checkpointing,
            s.synchronize_checkpoint_boundary, s.profile) == (True, True, 4, True, True, True)
    s = checkpointing.configure(cpu_checkpointing=True, number_checkpoints=2)
    assert s.cpu_checkpointing and s.number_checkpoints == 2 and not s.partition_activations
    with pytest.raises(ValueError, match="disagree"):
        checkpointing.configure(cpu_checkpointing=True, checkpoint_in_cpu=False)
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": true, "profile": true}}')
    s = checkpointing.configure(None, deepspeed_config=str(path), profile=False)  # explicit beats the file
    assert s.cpu_checkpointing and not s.profile and checkpointing.is_configured()
    with pytest.raises(ConfigError) as err:
        checkpointing.configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpointng": True}})
    assert err.value.key_path == "activation_checkpointing.cpu_checkpointng" and "cpu_checkpointing" in str(err.value)
    with pytest.raises(ConfigError, match="needs partition_activations"):
        checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=2)
    checkpointing.reset()
    assert not checkpointing.is_configured()


def test_initialize_configures_from_the_section(caplog):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    with caplog.at_level(logging.INFO, logger="zeroengine.checkpointing"):
        zeroengine.initialize(model=nn.Linear(2, 2), config=config)
    s = checkpointing.current()
    assert s.configured and s.partition_activations and s.cpu_checkpointing and s.partitions == 1
    assert "no effect" in caplog.text
    # no section and no mpu: a script's own configure() call is left alone
    checkpointing.configure(profile=True)
    without_section = {k: v for k, v in config.items() if k != "activation_checkpointing"}
    zeroengine.initialize(model=nn.Linear(2, 2), config=without_section)
    assert checkpointing.current().profile


def test_initialize_without_mpu_keeps_the_scripts_own_configure_with_its_group():
    # Megatron-DeepSpeed's order: configure(mpu, deepspeed_config=..., ...) first, then initialize(mpu=None).
    # Before, initialize reconfigured from the section and dropped the group and the explicit options.
    class MPU:
        def get_model_parallel_group(self):
            return None

        def get_model_parallel_world_size(self):
            return 2

        def get_model_parallel_rank(self):
            return 0

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"partition_activations": True}}
    checkpointing.configure(MPU(), deepspeed_config=config, checkpoint_in_cpu=True)
    zeroengine.initialize(model=nn.Linear(2, 2), config=config)
    s = checkpointing.current()
    assert s.partitions == 2 and s.cpu_checkpointing
    # settings an earlier initialize made are replaced by the next one's section
    checkpointing.reset()
    zeroengine.initialize(model=nn.Linear(2, 2), config=config)
    config["activation_checkpointing"] = {"cpu_checkpointing": True}
    zeroengine.initialize(model=nn.Linear(2, 2), config=config)
    assert checkpointing.current().cpu_checkpointing and not checkpointing.current().partition_activations
