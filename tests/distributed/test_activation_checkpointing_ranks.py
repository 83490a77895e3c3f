"""Activation checkpointing across ranks: under ZeRO stage 3, and with saved inputs partitioned over a
real 2-rank model-parallel group."""
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from model import GPT, Block, GPTConfig
from parity import base_config, global_batches

import zeroengine
from zeroengine import checkpointing
from zeroengine.testing import run_distributed
from zeroengine.zero import safe_get_full_fp32_param, safe_get_full_grad

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def _gpt(wrap: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    if wrap:
        checkpointing.checkpoint_modules(model, Block)
    return model


def _stage3_run(rank, world, wrap: bool, steps: int = 3, options=None):
    config = base_config(2, 1, world, 1.0, stage=3)
    checkpointing.reset()
    if options is not None:  # through initialize, as a user's config would
        config["activation_checkpointing"] = options
    engine, _, _, _ = zeroengine.initialize(model=_gpt(wrap), config=config)
    params = dict(engine.module.named_parameters())
    torch.manual_seed(100 + rank)  # each rank its own dropout masks, the same with and without checkpointing
    losses, grads = [], []
    for step in global_batches(steps, 1, world, 2):
        x, y = step[0][rank]
        loss = engine(x, y)
        engine.backward(loss)
        grads.append({n: safe_get_full_grad(p) for n, p in params.items()})
        engine.step()
        losses.append(loss.item())
    final = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    # Stage 3's prefetcher (where present) records the first pass's fetch order, recompute fetches included,
    # and replays it: a checkpointed model must not make it diverge from step to step.
    fetch = engine.optimizer.fetch_stats() if hasattr(engine.optimizer, "fetch_stats") else None
    return losses, grads, final, engine.memory_breakdown()["params"], fetch


# One step each with the storage options (partitioning has no model-parallel group here: kept whole).
_STAGE3_OPTIONS = [
    {"cpu_checkpointing": True},
    {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 2},
    {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 2,
     "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True, "profile": True},
]


def _stage3_all(rank, world):
    plain = _stage3_run(rank, world, wrap=False)
    default = _stage3_run(rank, world, wrap=True)
    others = [_stage3_run(rank, world, wrap=True, steps=1, options=o)[1][0] for o in _STAGE3_OPTIONS]
    return plain, default, others


def test_stage3_recompute_regathers_parameters_and_matches_the_plain_gradients():
    for plain, ckpt, others in run_distributed(_stage3_all, 2):
        for options, grads in zip(_STAGE3_OPTIONS, others):
            for name, ref in plain[1][0].items():
                torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=0, msg=f"{options} {name}")
        assert plain[0] == ckpt[0]  # losses, bit for bit
        for ref_step, step in zip(plain[1], ckpt[1]):
            assert ref_step.keys() == step.keys()
            for name in ref_step:
                torch.testing.assert_close(step[name], ref_step[name], atol=1e-6, rtol=0, msg=name)
        for name in plain[2]:
            torch.testing.assert_close(ckpt[2][name], plain[2][name], atol=1e-6, rtol=0, msg=name)
        assert ckpt[3] == plain[3]  # and after the recompute the parameters are sharded again
        if ckpt[4] is not None:
            assert (ckpt[4]["trace_recordings"], ckpt[4]["trace_divergences"]) == (1, 0), ckpt[4]
            assert ckpt[4]["prefetched"] > 0


class _MPU:
    """Megatron-style model-parallel unit over the whole (2-rank) world: each rank its own data-parallel group."""

    def __init__(self):
        from zeroengine.comm.groups import new_group

        self.alone = [new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]

    def get_data_parallel_group(self):
        return self.alone

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_model_parallel_world_size(self):
        return dist.get_world_size()

    def get_model_parallel_rank(self):
        return dist.get_rank()


def _grads(model, batch, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(*batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _partitioned(rank, world):
    zeroengine.init_distributed()
    mpu = _MPU()
    batch = global_batches(1, 1, 1, 2)[0][0][0]  # replicated: the same on both model-parallel ranks
    reference = _grads(_gpt(wrap=False), batch, seed=5)
    results = []
    for cpu, contiguous, sync, profile in itertools.product([False, True], repeat=4):
        checkpointing.configure(mpu, partition_activations=True, checkpoint_in_cpu=cpu,
                                contiguous_checkpointing=contiguous, num_checkpoints=CFG.n_layer,
                                synchronize=sync, profile=profile)
        grads = _grads(_gpt(wrap=True), batch, seed=5)
        worst = max((grads[n] - reference[n]).abs().max().item() for n in reference)
        results.append(((cpu, contiguous, sync, profile), worst))
    # what one rank keeps of a saved input: its padded 1/N slice (105 elements -> 53 each)
    checkpointing.configure(mpu, partition_activations=True)
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, requires_grad=True)
    node = checkpointing.checkpoint(lambda t: t.sin(), x).grad_fn
    kept = node.saved_inputs[0].data.clone()
    x_full = x.detach().clone()
    # initialize(mpu=...) passes the group on
    config = {**base_config(2, 1, 1, 0.0), "activation_checkpointing": {"partition_activations": True}}
    zeroengine.initialize(model=torch.nn.Linear(2, 2), config=config, mpu=mpu)
    return results, kept, x_full, checkpointing.current().partitions


def test_partitioned_saved_inputs_are_one_slice_per_rank_and_gradients_still_match():
    world = 2
    outcomes = run_distributed(_partitioned, world)
    for rank, (results, kept, x_full, partitions) in enumerate(outcomes):
        assert len(results) == 16
        for combo, worst in results:
            assert worst <= 1e-6, (rank, combo, worst)
        size = math.ceil(x_full.numel() / world)
        assert kept.numel() == size == 53
        flat = torch.cat([x_full.reshape(-1), torch.zeros(world * size - x_full.numel())])
        assert torch.equal(kept, flat[rank * size:(rank + 1) * size])
        assert partitions == world
    assert not torch.equal(outcomes[0][1], outcomes[1][1])


# -- a segment that reads its module's parameter directly, which is also used after the segment ------------

class _LayerScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.full((4,), 0.5))

    def _segment(self, h):
        return torch.tanh(h * self.scale)  # no submodule call: no hook gathers `scale` in the recompute

    def forward(self, x, y, ckpt: str):
        h = self.inp(x)
        if ckpt == "zeroengine":
            h = checkpointing.checkpoint(self._segment, h)
        elif ckpt == "torch":
            h = torch.utils.checkpoint.checkpoint(self._segment, h, use_reentrant=True)
        else:
            h = self._segment(h)
        # Used again after the segment: in backward this use completes `scale`'s gradient bucket first
        # (stage 3 then releases it), and the segment's recompute comes after.
        return torch.nn.functional.mse_loss(h * self.scale, y)


def _layer_scale_run(rank, world, ckpt: str, stage: int):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zeroengine.initialize(model=_LayerScale(), config=cfg)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        x, y = torch.randn(2 * world, 4, generator=g), torch.randn(2 * world, 4, generator=g)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2], ckpt))
        engine.step()
    held = engine.memory_breakdown()["params"]
    expected_held = engine.optimizer.layout.shard_numel * 4 if stage == 3 else held
    values = {n: safe_get_full_fp32_param(p) if stage else p.detach().clone()
              for n, p in engine.module.named_parameters()}
    return values, held == expected_held


def test_stage3_recompute_holds_the_enclosing_modules_parameters_a_segment_uses_directly():
    want, _ = run_distributed(_layer_scale_run, 2, "none", 0)[0]
    for got, released in run_distributed(_layer_scale_run, 2, "zeroengine", 3):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
        assert released  # nothing stays gathered after the steps


def _torch_reentrant(rank, world):
    try:
        _layer_scale_run(rank, world, "torch", 3)
    except zeroengine.zero.PartitionedParameterError as exc:
        return str(exc)
    return ""


def test_torch_reentrant_recompute_of_a_direct_use_names_the_cause():
    # torch's reentrant checkpoint cannot be told what to hold: the error says what happened and what to use
    for message in run_distributed(_torch_reentrant, 2):
        assert "'scale'" in message and "during backward" in message, message
        assert "zeroengine.checkpointing.checkpoint" in message and "use_reentrant=False" in message, message


def _retain_twice_and_recover(rank, world):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zeroengine.initialize(model=_LayerScale(), config=cfg)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    loss = engine(x, y, "zeroengine")
    engine.backward(loss, retain_graph=True)  # the segment is recomputed in each of the two backwards
    engine.backward(loss)
    engine.step()
    try:
        engine(torch.randn(2, 5), y, "zeroengine")  # a forward that raises inside a module (wrong width)
    except RuntimeError:
        pass
    hooks = engine.optimizer.hooks
    stale = hooks.running_units()  # still counted as running until the next forward starts
    engine.backward(engine(x, y, "zeroengine"))
    engine.backward(engine(x, y, "zeroengine"))
    engine.step()
    held = engine.memory_breakdown()["params"]
    return bool(stale), hooks.running_units(), held == engine.optimizer.layout.shard_numel * 4


def test_a_segment_recomputed_by_two_backwards_and_a_forward_that_raised_leave_nothing_held():
    for stale, running, released in run_distributed(_retain_twice_and_recover, 2):
        assert stale and running == () and released


class _PositionEmbedded(torch.nn.Module):
    """A root that adds its own parameter before a checkpointed block (a ViT's pos_embed)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.pos = torch.nn.Parameter(torch.randn(1, 16, 32) * 0.02)
        self.block = Block(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, idx, y):
        h = checkpointing.checkpoint(self.block, self.emb(idx) + self.pos)
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 64), y.view(-1))


def _position_embedded(rank, world, stage):
    engine, _, _, _ = zeroengine.initialize(model=_PositionEmbedded(), config=base_config(2, 1, world, 1.0,
                                                                                          stage=stage))
    losses = []
    for step in global_batches(2, 1, world, 2):
        x, y = step[0][rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_the_recompute_hold_leaves_units_it_did_not_gather_to_their_backward():
    # The hold around the recompute released `pos` (gathered by the root's backward, its gradient not yet
    # accumulated): its gradient then met an empty parameter.
    want = run_distributed(_position_embedded, 2, 0)
    got = run_distributed(_position_embedded, 2, 3)
    for a, b in zip(want, got):
        assert a == pytest.approx(b, abs=1e-6)
