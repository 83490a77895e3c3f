"""What checkpointing keeps: L saved inputs plus one block's activations, where they live, and how packed."""
import logging

import pytest
import torch
from model import GPT, Block, GPTConfig

from zeroengine import checkpointing
from zeroengine.activation_checkpointing import storage
from zeroengine.activation_checkpointing.memory_probe import LiveTensorBytes

B, T, D = 4, 128, 64


@pytest.fixture(autouse=True)
def _fresh_settings():
    checkpointing.reset()
    yield
    checkpointing.reset()


def _gpt(n_layer: int, wrap: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=n_layer, n_head=2, n_embd=D, dropout=0.1))
    if wrap:
        checkpointing.checkpoint_modules(model, Block)
    for p in model.parameters():  # gradients exist beforehand, so the probe sees activations only
        p.grad = torch.zeros_like(p)
    return model


def _peak_step_bytes(model) -> int:
    x = torch.randint(64, (B, T), generator=torch.Generator().manual_seed(0))
    with LiveTensorBytes() as probe:
        model(x, x).backward()
    return probe.peak["cpu"]


def test_probe_counts_live_storages_once():
    with LiveTensorBytes() as probe:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:]  # a view: no new storage
        b = a * 2
        del b
        c = torch.ones(250)
    assert probe.peak["cpu"] == 8000 and probe.live["cpu"] == 5000
    del a, view, c


def test_peak_activation_memory_falls_from_O_L_to_one_block_plus_L_inputs():
    depths = (4, 8, 16)
    plain = {L: _peak_step_bytes(_gpt(L, wrap=False)) for L in depths}
    ckpt = {L: _peak_step_bytes(_gpt(L, wrap=True)) for L in depths}
    saved_input = B * T * D * 4  # one block's input, fp32
    per_block = (plain[8] - plain[4]) / 4  # activations autograd keeps per block without checkpointing
    outside = plain[4] - 4 * per_block  # embeddings, head, loss
    assert per_block > 20 * saved_input
    assert plain[16] - plain[8] == pytest.approx(8 * per_block, rel=0.01)  # O(L)
    for L in depths:
        # about one block's activations (its recompute) plus the L saved inputs
        assert ckpt[L] <= (outside + per_block + L * saved_input) * 1.02, (L, ckpt[L])
    assert ckpt[16] - ckpt[4] == pytest.approx(12 * saved_input, rel=0.02)  # grows by one input per block
    assert ckpt[16] < plain[16] / 8


def _segment_node(n_layer=3, **settings):
    checkpointing.configure(**settings)
    model = _gpt(n_layer, wrap=True)
    x = torch.randint(64, (B, T))
    loss = model(x, x)
    return model, loss


def test_plain_recompute_keeps_only_the_inputs():
    checkpointing.configure()
    block = Block(GPTConfig(n_embd=D, n_head=2, block_size=T))
    x = torch.randn(B, T, D, requires_grad=True)
    node = checkpointing.checkpoint(block, x).grad_fn
    assert [t.data_ptr() for t in node.saved_tensors] == [x.data_ptr()]


def test_cpu_checkpointing_keeps_saved_inputs_on_the_cpu():
    checkpointing.configure(checkpoint_in_cpu=True)
    block = Block(GPTConfig(n_embd=D, n_head=2, block_size=T))
    x = torch.randn(B, T, D, requires_grad=True)
    node = checkpointing.checkpoint(block, x).grad_fn
    assert [s.data.device.type for s in node.saved_inputs] == ["cpu"]
    assert node.saved_inputs[0].device == x.device  # and the recompute gets it back where it was


def _checkpoint_nodes(loss):
    """Every checkpointed segment's autograd node in the graph behind ``loss``."""
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "saved_inputs"):
            found.append(node)
        stack.extend(f for f, _ in node.next_functions)
    return found


def test_contiguous_saved_inputs_share_one_buffer_that_rewinds_after_backward():
    L = 4
    model, loss = _segment_node(L, partition_activations=True, contiguous_memory_optimization=True,
                                number_checkpoints=L)
    (arena,) = storage.arenas().values()
    assert arena.buffer.numel() == L * B * T * D and arena.offset == arena.buffer.numel() and arena.leases == L
    base = arena.buffer.data_ptr()
    # every block's saved input is a slot of the one buffer
    slots = [s.data.data_ptr() for node in _checkpoint_nodes(loss) for s in node.saved_inputs]
    assert sorted(slots) == [base + i * B * T * D * 4 for i in range(L)]
    loss.backward()
    del loss
    assert arena.leases == 0 and arena.offset == 0
    # the next pass reuses the same buffer: no new allocation
    x = torch.randint(64, (B, T))
    model(x, x).backward()
    assert storage.arenas()[(arena.device, arena.dtype)].buffer.data_ptr() == base


def test_contiguous_buffer_too_small_grows_with_a_warning_and_dropped_graphs_return_their_slots(caplog):
    with caplog.at_level(logging.WARNING, logger="zeroengine.checkpointing"):
        model, loss = _segment_node(4, partition_activations=True, contiguous_memory_optimization=True,
                                    number_checkpoints=2)
    assert "is full" in caplog.text
    (arena,) = storage.arenas().values()
    assert arena.leases == 4
    del loss  # never backpropagated: the slots come back when the graph is freed
    assert arena.leases == 0 and arena.offset == 0
