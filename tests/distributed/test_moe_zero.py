"""MoE under ZeRO stages 0-3: expert gradients averaged over the expert-data-parallel group, expert
parameters (stage 3), gradients and optimizer state partitioned within it, clipping by the global norm;
parity with a single-process model holding every expert, frozen experts refused at stage 3, and
checkpoints round-tripping by global expert names.

Parity runs use SGD: Adam's update is invariant to the scale of a gradient, so it would hide a wrong
divisor of the expert gradients or a wrong global norm; SGD's is not."""
import pytest
import torch
from model import GPTConfig
from moe_model import MoEConfig, MoEGPT
from parity import base_config, copy_weights, delayed_update_step, global_batches

import zeroengine
from zeroengine.config import ConfigError
from zeroengine.moe import expert_checkpoint_names, is_expert_param
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS, MICRO, LR, SGD_LR = 4, 2, 1e-2, 0.5


def make_model(ep_size, drop_tokens=False, seed=0):
    torch.manual_seed(seed)
    return MoEGPT(TINY, MoEConfig(num_experts=4, ep_size=ep_size, k=2, drop_tokens=drop_tokens, min_capacity=0))


def reference_run(world, clip, gas=1, drop_tokens=False):
    """One process, every expert: each rank's micro-batch routed on its own (capacity is per rank)."""
    model = make_model(1, drop_tokens)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for step in global_batches(STEPS, gas, world, MICRO):
        loss = sum(model(x, y) for micro_step in step for x, y in micro_step) / (world * gas)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(rank, world, stage, ep_size, clip, gas=1, drop_tokens=False, seed=0, sgd=False, offload_ratio=None,
            fetch_unit="module"):
    model = make_model(ep_size, drop_tokens, seed)
    names = expert_checkpoint_names(model)
    cfg = base_config(MICRO, gas, world, clip, lr=LR, stage=stage)
    if stage == 3:
        cfg["zero_optimization"]["stage3_fetch_unit"] = fetch_unit
    if sgd:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": SGD_LR}}
    if offload_ratio is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": offload_ratio}
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    return engine, names


def _train(engine, rank, world, gas, steps):
    for step in global_batches(STEPS, gas, world, MICRO)[:steps]:
        for micro_step in step:
            x, y = micro_step[rank]
            engine.backward(engine(x, y))
            engine.step()


def _global_params(engine, names):
    with GatheredParameters(list(engine.module.parameters())):  # (stage 3: whole for the copy)
        return {names.get(n, n): p.detach().float().clone() for n, p in engine.module.named_parameters()}


def train_parity(rank, world, stage, ep_size, clip, gas, drop_tokens):
    engine, names = _engine(rank, world, stage, ep_size, clip, gas, drop_tokens, sgd=True)
    _train(engine, rank, world, gas, STEPS)
    experts = sum(p.numel() for p in engine.module.parameters() if is_expert_param(p))
    return _global_params(engine, names), experts, engine.memory_breakdown()


@pytest.mark.parametrize("stage,world,ep_size,clip,gas,drop", [
    (1, 2, 2, 0.5, 2, False), (2, 2, 2, 0.5, 1, True), (2, 4, 2, 0.5, 2, False), (0, 4, 2, 0.5, 1, False),
    (3, 2, 2, 0.5, 1, True), (3, 4, 2, 0.5, 2, False), (3, 2, 1, 0.5, 1, False)])
def test_matches_single_process_with_every_expert(stage, world, ep_size, clip, gas, drop):
    ref = reference_run(world, clip, gas, drop)
    results = run_distributed(train_parity, world, stage, ep_size, clip, gas, drop)
    for params, _, _ in results:
        assert set(params) <= set(ref)
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    # together the ranks of one EP group hold every expert
    held = set().union(*(set(r[0]) for r in results[:ep_size]))
    assert held == set(ref)
    if stage >= 2:
        # fp32 gradient shards (stage 3: parameter shards too): dense / world + experts / (world / ep_size) per
        # rank, plus bucket padding
        _, expert_numel, mem = results[0]
        dense = sum(p.numel() for n, p in ref.items() if ".local_experts." not in n and n != "head.weight")
        expected = 4 * (dense / world + expert_numel / (world // ep_size))
        for kind in ("grads", "params") if stage == 3 else ("grads",):
            assert expected <= mem[kind] <= expected * 1.1, (kind, mem[kind], expected)


def stage3_blocks_parity(rank, world):
    engine, names = _engine(rank, world, 3, 2, 0.5, sgd=True, fetch_unit="block")
    _train(engine, rank, world, 1, STEPS)
    return _global_params(engine, names)


def test_stage3_fetching_whole_blocks_matches_single_process():
    """stage3_fetch_unit "block" (what engine.compile() uses) regroups the fetches; the MoE layers inside
    the blocks, whose routing reads the gate's weight directly, are still gathered when they run."""
    ref = reference_run(2, 0.5)
    for params in run_distributed(stage3_blocks_parity, 2):
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def offloaded_parity(rank, world, ratio):
    engine, names = _engine(rank, world, 2, 2, 0.5, sgd=True, offload_ratio=ratio)
    _train(engine, rank, world, 1, STEPS)
    parts = engine.optimizer.parts
    host = [sum(p.on_host(b.index) for b in p.layout.buckets) for p in parts]
    return _global_params(engine, names), host, [len(p.layout.buckets) for p in parts]


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_offloaded_optimizer_with_experts_matches_single_process(ratio):
    """The dense and expert domains each stream their offloaded buckets; the norm and clip span both, and
    (partial offload) no piece steps twice though one torch optimizer holds every domain's pieces."""
    ref = reference_run(2, 0.5)
    for params, host, buckets in run_distributed(offloaded_parity, 2, ratio):
        if ratio == 1.0:
            assert host == buckets
        else:
            assert any(0 < h < n for h, n in zip(host, buckets)), (host, buckets)
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def stage3_refused(rank, world, ep_size, frozen):
    model = make_model(ep_size)
    if frozen:  # tuning the rest with the experts frozen: the optimizer steps no expert parameter
        for p in model.parameters():
            if is_expert_param(p):
                p.requires_grad_(False)
    cfg = base_config(2, 1, world, 0.0, stage=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="zero_optimization.stage.*does not support frozen MoE expert"):
        zeroengine.initialize(model=model, config=cfg)
    # refused before anything was partitioned: the model is as it was
    return all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("ep_size,frozen", [(2, True), (1, True)])
def test_stage3_with_frozen_experts_is_refused(ep_size, frozen):
    # Frozen experts were accepted before: at ep_size 2 each rank's experts were overwritten by others' values
    # at initialize, and at ep_size 1 the router's partitioned weight failed in forward.
    assert run_distributed(stage3_refused, 2, ep_size, frozen) == [True, True]


def checkpoint_round_trip(rank, world, tmp, stage):
    straight, names = _engine(rank, world, stage, 2, 0.5)
    _train(straight, rank, world, 1, STEPS)
    first, _ = _engine(rank, world, stage, 2, 0.5)
    _train(first, rank, world, 1, 2)
    first.save_checkpoint(tmp, tag="half")
    resumed, _ = _engine(rank, world, stage, 2, 0.5, seed=123)  # different initial weights: the load must win
    resumed.load_checkpoint(tmp, tag="half")
    assert resumed.global_steps == 2
    for step in global_batches(STEPS, 1, world, MICRO)[2:]:
        x, y = step[0][rank]
        resumed.backward(resumed(x, y))
        resumed.step()
    a, b = _global_params(straight, names), _global_params(resumed, names)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    return sorted(n for n in a if ".local_experts." in n)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpoint_round_trips(tmp_path, stage):
    names = run_distributed(checkpoint_round_trip, 2, str(tmp_path), stage)
    assert set(names[0]).isdisjoint(names[1])  # each rank saved its own experts under global names


def stacked_places_at_stage3(rank, world):
    from zeroengine.moe import MoE, expert_checkpoint_places

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, expert, num_experts=4, ep_size=2, k=1,
                                                           expert_layout="stacked"))
    cfg = base_config(2, 1, world, 0.0, stage=3)
    zeroengine.initialize(model=model, config=cfg)
    places = expert_checkpoint_places(model)
    return {name: (place.offset, place.shape) for name, place in places.items()}


def test_stacked_experts_have_their_global_places_at_stage3():
    """At stage 3 a stacked expert parameter is partitioned (empty between uses): its place in a checkpoint
    comes from its full shape."""
    for rank, places in enumerate(run_distributed(stacked_places_at_stage3, 2)):
        w1 = places["1.local_experts.w1"]
        assert w1 == (rank * 2 * 16 * 8, (4, 16, 8)), w1
        assert places["1.local_experts.b2"] == (rank * 2 * 8, (4, 8))


def _decaying(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def stale_reference_run(world, clip, warmup):
    """One process, every expert, with offload's delayed update (update t uses gradients taken before update
    t-1 reached the weights, after ``warmup`` fresh steps), SGD under a torch LambdaLR."""
    model = make_model(1)
    master = make_model(1)  # the same seed: the same weights (a deepcopy would copy the expert process groups)
    opt = torch.optim.SGD(master.parameters(), lr=SGD_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _decaying)
    for i, step in enumerate(global_batches(STEPS, 1, world, MICRO)):
        loss = sum(model(x, y) for micro_step in step for x, y in micro_step) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        delayed_update_step(model, master, opt, sched, delayed=i >= warmup)
    copy_weights(model, master)  # the last update lands (the engine's land_delayed_update)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def delayed_with_experts(rank, world, warmup):
    model = make_model(2)
    names = expert_checkpoint_names(model)
    cfg = base_config(MICRO, 1, world, 0.5, lr=LR, stage=2)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": SGD_LR}}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "delayed_update": True,
                                                     "delayed_update_warmup_steps": warmup}
    engine, _, _, _ = zeroengine.initialize(
        model=model, config=cfg, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _decaying))
    _train(engine, rank, world, 1, STEPS)
    engine.optimizer.land_delayed_update()
    return _global_params(engine, names)


def test_delayed_update_with_expert_domains_follows_the_stale_schedule():
    """Each domain (dense, experts) runs its own background step, one at a time, with the rate of its step
    (a torch scheduler moves it right after): the stale schedule of one process holding every expert."""
    ref = stale_reference_run(2, 0.5, warmup=1)
    fresh = stale_reference_run(2, 0.5, warmup=STEPS)  # never delayed
    assert max(float((ref[n] - fresh[n]).abs().max()) for n in ref) > 1e-3  # the schedules differ
    for params in run_distributed(delayed_with_experts, 2, 1):
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
