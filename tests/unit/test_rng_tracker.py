"""The model-parallel RNG tracker (``checkpointing.get_cuda_rng_tracker``) and AutoTP's split regions, in one
process: streams fork and come back, seed like Megatron, survive a save and a checkpointed recompute, and a
region forks exactly from a block's entry to its row-parallel layer. Across ranks: tests/distributed/
test_tensor_parallel_rng.py."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroengine import checkpointing
from zeroengine.activation_checkpointing.rng_tracker import MODEL_PARALLEL_RNG
from zeroengine.tensor_parallel.rng import SplitRegion


def draws(n: int = 8, generator=None) -> torch.Tensor:
    return torch.rand(n, generator=generator)


def test_fork_draws_from_the_stream_and_leaves_the_default_where_it_was():
    tracker = checkpointing.RNGStatesTracker()
    tracker.add("a", 100)
    torch.manual_seed(1)
    expected_outer = torch.cat([draws(), draws()])
    torch.manual_seed(1)
    outer = [draws()]
    with tracker.fork("a"):
        inside = [draws()]
    outer.append(draws())
    with tracker.fork("a"):  # the stream goes on where it stopped
        inside.append(draws())
    stream = torch.Generator().manual_seed(100)
    torch.testing.assert_close(torch.cat(inside), torch.cat([draws(generator=stream), draws(generator=stream)]),
                               atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(outer), expected_outer, atol=0, rtol=0)


def test_an_exception_inside_a_fork_still_restores_the_default():
    tracker = checkpointing.RNGStatesTracker()
    tracker.add("a", 5)
    torch.manual_seed(2)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.fork("a"):
            draws()
            raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), before)


def test_get_and_set_states_rewind_every_stream_and_load_weights_only():
    tracker = checkpointing.RNGStatesTracker()
    tracker.add("a", 10)
    tracker.add("b", 11)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first_a = draws()
    with tracker.fork("b"):
        first_b = draws()
    buffer = io.BytesIO()
    torch.save(saved, buffer)  # a Megatron-style checkpoint keeps the tracker's states
    buffer.seek(0)
    tracker.set_states(torch.load(buffer, weights_only=True))
    with tracker.fork("a"):
        torch.testing.assert_close(draws(), first_a, atol=0, rtol=0)
    with tracker.fork("b"):
        torch.testing.assert_close(draws(), first_b, atol=0, rtol=0)
    assert tracker.seeds == {10, 11}
    with pytest.raises(TypeError, match="expected what get_states"):
        tracker.set_states({"a": torch.get_rng_state()})


def test_names_and_seeds_are_added_once_and_forks_need_an_added_name():
    tracker = checkpointing.RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="'c' is not in the tracker"):
        with tracker.fork("c"):
            pass
    tracker.reset()
    tracker.add("a", 1)  # a fresh start after reset


def test_model_parallel_seeding_is_megatrons():
    checkpointing.model_parallel_cuda_manual_seed(42, model_parallel_rank=1)
    tracker = checkpointing.get_cuda_rng_tracker()
    assert tracker.seeds == {42 + 2718 + 1}
    default = draws()
    torch.manual_seed(42)
    torch.testing.assert_close(default, draws(), atol=0, rtol=0)  # the default: the seed itself, as on every rank
    with tracker.fork():
        split = draws()
    torch.testing.assert_close(split, draws(generator=torch.Generator().manual_seed(42 + 2718 + 1)), atol=0, rtol=0)
    checkpointing.model_parallel_reconfigure_tp_seed(7, model_parallel_rank=1)  # DeepSpeed's: that stream only
    assert tracker.seeds == {7 + 2718 + 1}
    with tracker.fork(MODEL_PARALLEL_RNG):
        torch.testing.assert_close(draws(), draws(generator=torch.Generator().manual_seed(7 + 2718 + 1)),
                                   atol=0, rtol=0)


def test_the_rank_defaults_to_the_configured_mpu_rank():
    class Mpu:  # a model-parallel unit of two ranks, this being the second (no group is used to seed)
        def get_model_parallel_group(self):
            return None

        def get_model_parallel_world_size(self):
            return 2

        def get_model_parallel_rank(self):
            return 1

    checkpointing.configure(Mpu())
    checkpointing.model_parallel_cuda_manual_seed(3)
    assert checkpointing.get_cuda_rng_tracker().seeds == {3 + 2718 + 1}


def test_the_deepspeed_alias_has_the_names():
    from zeroengine.integrations import ds_compat

    for name in ("get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed"):
        assert getattr(ds_compat.checkpointing, name) is getattr(checkpointing, name)


def test_a_recompute_replays_the_streams_and_then_leaves_them_where_the_forward_did():
    """Megatron's CheckpointFunction saves and restores the tracker: the recompute draws the forward's split masks,
    and afterwards the stream is where a plain forward + backward leaves it (the next step's masks are unchanged)."""
    lin = nn.Linear(16, 16)
    tracker = checkpointing.get_cuda_rng_tracker()

    def segment(x):
        with tracker.fork():
            x = F.dropout(lin(x), 0.5)
        return F.dropout(x, 0.5)

    def step(checkpointed: bool):
        checkpointing.model_parallel_cuda_manual_seed(9, model_parallel_rank=0)
        x = torch.randn(4, 16, requires_grad=True)
        y = checkpointing.checkpoint(segment, x) if checkpointed else segment(x)
        y.pow(2).sum().backward()
        with tracker.fork():
            after = draws()
        grads = (x.grad.clone(), lin.weight.grad.clone())
        lin.zero_grad(set_to_none=True)
        return grads, after, draws()

    (ref_grads, ref_split, ref_default), (grads, split, default) = step(False), step(True)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=0, rtol=0)
    torch.testing.assert_close(split, ref_split, atol=0, rtol=0)
    torch.testing.assert_close(default, ref_default, atol=0, rtol=0)


class Block(nn.Module):
    """A column layer, dropout on its (split) output, a row layer, dropout on the (replicated) result."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.up, self.down, self.fail = nn.Linear(8, 8), nn.Linear(8, 8), fail
        self.masks = []

    def forward(self, x):
        h = F.dropout(self.up(x), 0.5)
        self.masks.append(("split", h == 0))
        if self.fail:
            raise RuntimeError("before the row layer")
        out = F.dropout(self.down(h), 0.5)
        self.masks.append(("replicated", out == 0))
        return out


def test_a_split_region_forks_from_the_block_entry_to_its_row_layer():
    block = Block()
    region = SplitRegion.around(block, block.down)
    x = torch.randn(64, 8)
    checkpointing.model_parallel_cuda_manual_seed(4, model_parallel_rank=0)
    block(x)
    assert not region.is_open
    (_, split), (_, replicated) = block.masks
    torch.manual_seed(4)  # the default stream: only the replicated dropout draws from it
    torch.testing.assert_close(replicated, F.dropout(torch.ones(64, 8), 0.5) == 0, atol=0, rtol=0)
    stream = torch.Generator().manual_seed(4 + 2718)
    state, default = stream.get_state(), torch.get_rng_state()
    torch.set_rng_state(state)
    expected_split = F.dropout(torch.ones(64, 8), 0.5) == 0
    torch.set_rng_state(default)
    torch.testing.assert_close(split, expected_split, atol=0, rtol=0)


def test_a_block_that_raises_inside_its_region_does_not_leave_the_fork_open():
    checkpointing.model_parallel_cuda_manual_seed(4, model_parallel_rank=0)
    block = Block(fail=True)
    region = SplitRegion.around(block, block.down)
    x = torch.randn(2, 8)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="before the row layer"):
        block(x)
    assert not region.is_open and torch.equal(torch.get_rng_state(), before)


@pytest.mark.gpu
def test_a_fork_switches_the_cuda_generator_once_cuda_is_in_use():
    x = torch.ones(4096, device="cuda")  # (CUDA started: its generator is switched too)
    tracker = checkpointing.RNGStatesTracker()
    tracker.add("a", 77)
    torch.cuda.manual_seed(5)
    before = torch.cuda.get_rng_state()
    with tracker.fork("a"):
        inside = F.dropout(x, 0.5)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    torch.cuda.manual_seed(77)  # a stream's CUDA state is made from its seed on first use
    torch.testing.assert_close(inside, F.dropout(x, 0.5), atol=0, rtol=0)
