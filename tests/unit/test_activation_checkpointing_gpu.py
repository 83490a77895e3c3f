"""On a CUDA device: CUDA RNG replay (dropout) and cpu_checkpointing taking saved inputs off the GPU."""
import pytest
import torch
import torch.nn as nn
from model import Block, GPTConfig

from zeroengine import checkpointing

pytestmark = pytest.mark.gpu

CFG = GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=256, dropout=0.1)
B = 4


@pytest.fixture(autouse=True)
def _fresh_settings():
    checkpointing.reset()
    yield
    checkpointing.reset()


def _stack():
    torch.manual_seed(0)
    return nn.ModuleList(Block(CFG) for _ in range(CFG.n_layer)).cuda()


def _run(blocks, x, wrap):
    h = x
    for b in blocks:
        h = checkpointing.checkpoint(b, h) if wrap else b(h)
    return h


@pytest.mark.parametrize("cpu", [False, True])
def test_cuda_dropout_is_replayed_and_cpu_checkpointing_frees_the_saved_inputs(cpu):
    blocks = _stack()
    x = torch.randn(B, CFG.block_size, CFG.n_embd, device="cuda", requires_grad=True)
    torch.cuda.manual_seed(3)
    _run(blocks, x, wrap=False).square().sum().backward()
    ref = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    x.grad = None

    checkpointing.configure(checkpoint_in_cpu=cpu)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.manual_seed(3)
    out = _run(blocks, x, wrap=True)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.square().sum().backward()
    for g, r in zip([p.grad for p in blocks.parameters()] + [x.grad], ref):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)
    one = B * CFG.block_size * CFG.n_embd * 4  # one block input, fp32
    # Alive on the GPU after the forward: the output, plus the inputs of blocks 1..L-1 unless they went to
    # the CPU (block 0's input is x, which the caller holds either way).
    expected = one * (1 if cpu else CFG.n_layer)
    assert expected <= held < expected + one // 2, (held, expected)


def test_saved_inputs_go_to_pinned_host_memory_and_come_back():
    checkpointing.configure(checkpoint_in_cpu=True, partition_activations=True, contiguous_checkpointing=True,
                            num_checkpoints=2)
    blocks = _stack()
    x = torch.randn(B, CFG.block_size, CFG.n_embd, device="cuda", requires_grad=True)
    node = checkpointing.checkpoint(blocks[0], x).grad_fn
    saved = node.saved_inputs[0]
    assert saved.data.device.type == "cpu" and saved.data.is_pinned() and saved.device.type == "cuda"
    restored = saved.restore()
    assert restored.is_cuda and torch.equal(restored, x.detach())
