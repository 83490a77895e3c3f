"""Stage-0 engine behaviour beyond parity: accumulation, memory and comm accounting, initialize() inputs."""
import pytest
import torch
from parity import base_config, global_batches, make_model

import zeroengine
from zeroengine import comm
from zeroengine.testing import run_distributed


def _numel(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields the tied weight once


def _no_comm_between_boundaries(rank, world):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=base_config(2, 3, world, clip=1.0))
    psi = _numel(engine.module)
    counts = []
    for micro_step in global_batches(1, 3, world, 2)[0]:
        comm.counters.reset()
        x, y = micro_step[rank]
        engine.backward(engine(x, y))
        engine.step()
        counts.append(comm.counters.snapshot())
    return psi, counts


def test_accumulation_communicates_only_at_the_boundary():
    world = 2
    for psi, counts in run_distributed(_no_comm_between_boundaries, world):
        assert counts[0] == {} and counts[1] == {}
        # the boundary all-reduces every gradient exactly once: 2*Psi*(N-1)/N fp32 elements on the wire
        assert counts[2]["all_reduce"]["payload_bytes"] == 4 * psi
        assert counts[2]["all_reduce"]["wire_bytes"] == pytest.approx(4 * 2 * psi * (world - 1) / world)


def _memory(rank, world, dtype):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=base_config(2, 1, world, 0.0, dtype=dtype))
    psi = _numel(engine.module)
    for step in global_batches(2, 1, world, 2):
        x, y = step[0][rank]
        engine.backward(engine(x, y))
        before_step = engine.memory_breakdown()  # gradients are alive here
        engine.step()
    return psi, before_step


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_memory_breakdown_matches_design_formula(dtype):
    psi, mem = run_distributed(_memory, 2, dtype)[0]
    width = 4 if dtype == "fp32" else 2
    assert mem["params"] == width * psi
    assert mem["grads"] == width * psi
    assert mem["master_params"] == (0 if dtype == "fp32" else 4 * psi)
    assert mem["optimizer_states"] == 8 * psi
    total = sum(mem[k] for k in ("params", "grads", "optimizer_states", "master_params"))
    assert total == 16 * psi  # docs/concepts.md: stage 0 holds 16 bytes per parameter in both precisions
    assert mem["cpu"] == total + mem["buffers"] and mem["device"] == 0


def test_world_of_one_without_a_launcher_and_callable_optimizer():
    cfg = base_config(4, 1, 1, clip=0.0)
    del cfg["optimizer"]
    engine, opt, loader, sched = zeroengine.initialize(
        model=make_model(), config=cfg, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert engine.world_size == 1 and loader is None and sched is None
    x, y = global_batches(1, 1, 1, 4)[0][0][0]
    first = engine(x, y)
    for _ in range(5):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    assert loss.item() < first.item()
    assert isinstance(opt.optimizer, torch.optim.SGD)


def test_optimizer_in_config_and_argument_is_refused():
    with pytest.raises(zeroengine.ConfigError, match="optimizer"):
        zeroengine.initialize(model=make_model(), config=base_config(4, 1, 1, 0.0),
                              optimizer=torch.optim.SGD(make_model().parameters(), lr=0.1))


def _scheduler_and_loader(rank, world):
    cfg = base_config(2, 1, world, 0.0)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}}
    tokens = torch.randint(64, (20, 16))
    tokens[:, 0] = torch.arange(20)  # the first token names the sample, so shards can be compared
    data = torch.utils.data.TensorDataset(tokens, torch.randint(64, (20, 16)))
    engine, _, loader, sched = zeroengine.initialize(model=make_model(), config=cfg, training_data=data)
    lrs = [engine.get_lr()[0]]
    seen = []
    for x, y in loader:
        seen.extend(x[:, 0].tolist())
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs, seen, len(loader)


def test_config_scheduler_steps_per_optimizer_step_and_loader_shards_data():
    (lrs0, seen0, n0), (lrs1, seen1, n1) = run_distributed(_scheduler_and_loader, 2)
    assert n0 == n1 == 5  # 20 samples / 2 ranks / micro 2
    assert lrs0 == lrs1
    # DeepSpeed's WarmupLR: the first optimizer step runs at iteration 0 (lr = min), and each
    # engine.step() advances one iteration: linear warmup of 0.01/4 per step.
    assert lrs0 == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01])
    assert sorted(seen0 + seen1) == list(range(20))  # each sample read by exactly one rank


def _epochs_read(rank, world, epochs):
    data = torch.utils.data.TensorDataset(torch.arange(24))
    _, _, loader, _ = zeroengine.initialize(model=make_model(), config=base_config(2, 1, world, 0.0),
                                            training_data=data)
    return [[x.item() for (batch,) in loader for x in batch] for _ in range(epochs)]


def test_the_initialize_loader_reshuffles_each_epoch_keeping_the_ranks_shares_disjoint():
    """No set_epoch in the loop: each pass over the loader initialize returns is the next epoch (as with
    DeepSpeedDataLoader), the ranks' shares of each epoch are disjoint and cover the data, and the order is the
    one DistributedSampler gives for the default seed (0) and that epoch, in any process."""
    read = run_distributed(_epochs_read, 2, 3)
    for epoch in range(3):
        assert sorted(read[0][epoch] + read[1][epoch]) == list(range(24)), epoch
    for rank in range(2):
        assert len({tuple(order) for order in read[rank]}) == 3
        for epoch in range(3):
            sampler = torch.utils.data.DistributedSampler(range(24), num_replicas=2, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            assert read[rank][epoch] == list(sampler)


def _static_scale_and_debug(rank, world):
    cfg = base_config(2, 1, world, 1.0, dtype="fp16", stage=2)
    cfg["fp16"] = {"enabled": True, "loss_scale": 128}
    cfg["comm_debug"] = True
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    checking = comm.backend.state.checker is not None
    losses = []
    x, y = global_batches(1, 1, world, 2)[0][0][rank]
    for _ in range(3):  # the same batch each step, so the loss must fall
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    comm.disable_sequence_check()
    return checking, engine.loss_scale, engine.skipped_steps, losses


def test_static_loss_scale_and_comm_debug_from_config():
    for checking, scale, skipped, losses in run_distributed(_static_scale_and_debug, 2):
        assert checking  # "comm_debug": true turned the collective-sequence checker on
        assert scale == 128 and skipped == 0  # a static scale never moves
        assert losses[-1] < losses[0]


def _overflow_step(rank, world, stage):
    cfg = base_config(2, 1, world, 1.0, dtype="fp16", stage=stage)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, optimizer, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    x, y = global_batches(1, 1, world, 2)[0][0][rank]
    seen = []
    for poison in (True, False):
        loss = engine(x, y)
        engine.backward(loss * (float("inf") if poison else 1.0))
        engine.step()
        seen.append((optimizer.overflow, optimizer.cur_scale, engine.get_global_grad_norm()))
    try:
        optimizer.state_dict()
    except AttributeError as err:
        hint = str(err)
    return seen, hasattr(optimizer, "state_dict"), hint


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_optimizer_accessors_and_the_overflow_norm(stage):
    # DeepSpeed scripts log optimizer.cur_scale; Hugging Face accelerate reads optimizer.overflow to tell
    # a skipped step; the norm of an overflowing step is inf at every stage (stage 0 gave nan)
    seen, has_state_dict, hint = run_distributed(_overflow_step, 1, stage)[0]
    (overflow0, scale0, norm0), (overflow1, scale1, norm1) = seen
    assert overflow0 and scale0 == 128 and norm0 == float("inf")
    assert not overflow1 and scale1 == 128 and 0 < norm1 < float("inf")
    assert not has_state_dict and "engine.save_checkpoint" in hint
