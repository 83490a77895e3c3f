"""``bf16.bf16_master_weights_and_grads`` (the optimizer steps the bf16 parameters, no fp32 copy) and
``bf16_optimizer_states`` (Adam's moments in bf16) at ZeRO stages 1-3 on 2 gloo ranks: the optimizer computes in
fp32 and rounds each result to its storage (zeroengine/optim/lean_adam.py); the runs track the fp32 reference as
bf16 training does, hold what the memory model says, and checkpoint across precisions."""
import pytest
import torch
from parity import base_config, engine_losses, global_batches, make_model, reference_run
from test_checkpoint_reshard import MORE, SAVE_AT, config, train

import zeroengine
from zeroengine.config import ConfigError
from zeroengine.optim.lean_adam import LeanAdam
from zeroengine.testing import run_distributed

STEPS = 6


def _config(stage, masters=True, states=False, world=2):
    cfg = base_config(2, 2, world, 0.5, dtype="bf16", stage=stage)
    cfg["bf16"].update(bf16_master_weights_and_grads=masters, bf16_optimizer_states=states)
    return cfg


def _first_moment_sum(opt) -> float:
    """Sum over the ranks of |exp_avg|: Adam's first moment carries the gradient's scale (unscaling, clipping),
    which its update divides away."""
    return zeroengine.comm.all_reduce_scalar(sum(float(s["exp_avg"].float().abs().sum()) for s in opt.state.values()))


def train_bf16(rank, world, stage, masters, states):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=_config(stage, masters, states))
    losses = engine_losses(engine, global_batches(STEPS, 2, world, 2), rank, world)
    opt = engine.optimizer.optimizer
    moments = {v.dtype for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")}
    stepped = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return losses, engine.memory_breakdown(), moments, stepped, type(opt).__name__, _first_moment_sum(opt)


@pytest.mark.parametrize("stage,states", [(1, False), (3, True)])  # (stage 2: the two tests below)
def test_tracks_fp32_and_keeps_what_the_memory_model_says(stage, states):
    ref_losses, _ = reference_run(STEPS, 2, 2, micro=2, clip=0.5)
    for losses, mem, moments, stepped, name, _ in run_distributed(train_bf16, 2, stage, True, states):
        assert name == "LeanAdam"
        for got, want in zip(losses, ref_losses):  # bf16 training's tolerance (test_zero_parity)
            assert abs(got - want) <= 0.02 * want, (losses, ref_losses)
        assert mem["master_params"] == 0  # the chunks the optimizer steps are the bf16 parameters
        assert moments == {torch.bfloat16 if states else torch.float32}
        assert mem["optimizer_states"] == (4 if states else 8) * stepped


def train_offloaded(rank, world, stage, states, ratio, delayed):
    cfg = _config(stage, True, states)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": ratio, "delayed_update": delayed,
                                                     "delayed_update_warmup_steps": 2}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    losses = engine_losses(engine, global_batches(STEPS, 2, world, 2), rank, world)
    opt = engine.optimizer.optimizer
    moments = {v.dtype for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")}
    stepped = sum(p.numel() for g in opt.param_groups for p in g["params"])
    host = sum(c.numel() for b, c in enumerate(engine.optimizer.chunks) if engine.optimizer.on_host(b))
    predicted = zeroengine.estimate_memory(engine.optimizer.layout.param_numel, world, stage, ratio,
                                           dtype=torch.bfloat16, bf16_masters=True, bf16_optimizer_states=states)
    return losses, engine.memory_breakdown(), moments, stepped, host, opt.backend, predicted, _first_moment_sum(opt)


@pytest.mark.parametrize("stage,states,ratio,delayed", [(1, True, 1.0, False), (2, False, 0.5, False),
                                                        (3, True, 1.0, True)])
def test_offloaded_bf16_masters_step_in_the_cpu_adam_as_in_memory(stage, states, ratio, delayed):
    """With offload_optimizer (DeepSpeed's home for bf16 masters) the C++ CPU Adam steps the offloaded bf16 chunks,
    fp32 or bf16 moments, from bf16 gradients unscaled and clipped as in memory: the run is the in-memory (LeanAdam)
    one up to where the two fp32 formulas round an update to a different bf16 value; partial offload steps the
    resident share in the same kernel, and the delayed update trains as a one-step-delayed run."""
    ref_losses, _ = reference_run(STEPS, 2, 2, micro=2, clip=0.5)
    in_memory, *_, in_memory_moment = run_distributed(train_bf16, 2, stage, True, states)[0]
    for losses, mem, moments, stepped, host, backend, predicted, moment in run_distributed(
            train_offloaded, 2, stage, states, ratio, delayed):
        assert backend.startswith("cpp-")
        assert moments == {torch.bfloat16 if states else torch.float32}
        for got, want in zip(losses, ref_losses):  # bf16 training's tolerance (test_zero_parity)
            assert abs(got - want) <= 0.02 * want, (losses, ref_losses)
        if not delayed:  # (measured: at most 8e-5 apart over the 6 steps)
            assert losses == pytest.approx(in_memory, rel=5e-4), (losses, in_memory)
            # Adam hides a gradient off by a constant factor (a clip or unscale missed on the host); its first
            # moment does not: gradient clipping 0.5 scales these gradients
            assert moment == pytest.approx(in_memory_moment, rel=1e-2), (moment, in_memory_moment)
        assert 0 < host <= stepped and (host < stepped) == (ratio < 1)
        assert mem["master_params"] == 2 * host  # only the offloaded share is a (bf16) copy
        assert mem["optimizer_states"] == (4 if states else 8) * stepped
        # estimate_memory predicts both before anything runs (the layout's padding apart; whole buckets offload)
        assert mem["optimizer_states"] == pytest.approx(predicted["optimizer_states"], rel=0.05)
        if ratio == 1.0:
            assert mem["master_params"] == pytest.approx(predicted["master_params"], rel=0.05)


def test_fp32_masters_are_what_bf16_masters_save():
    """The same run with fp32 masters holds 4 bytes per stepped element more (the copy bf16 masters drop)."""
    (_, lean, _, stepped, _, _), _ = run_distributed(train_bf16, 2, 2, True, True)
    (_, full, _, _, _, _), _ = run_distributed(train_bf16, 2, 2, False, False)
    assert full["master_params"] == 4 * stepped and lean["master_params"] == 0
    assert full["optimizer_states"] - lean["optimizer_states"] == 4 * stepped


def test_lean_adam_is_torchs_adam_in_fp32_and_rounds_only_its_storage_in_bf16():
    g = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(40, 30, generator=g), [torch.randn(40, 30, generator=g) for _ in range(4)]
    for adamw in (True, False):
        ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
        a = LeanAdam([ours], lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
        b = (torch.optim.AdamW if adamw else torch.optim.Adam)([theirs], lr=1e-2, weight_decay=0.1, foreach=False)
        for grad in grads:
            ours.grad, theirs.grad = grad.clone(), grad.clone()
            a.step()
            b.step()
        assert torch.equal(ours, theirs)
    # bf16 storage: one step is torch's fp32 step on the widened values, each result rounded to bf16
    lean = torch.nn.Parameter(p0.bfloat16())
    wide = torch.nn.Parameter(p0.bfloat16().float())
    a = LeanAdam([lean], lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16)
    b = torch.optim.AdamW([wide], lr=1e-2, weight_decay=0.1, foreach=False)
    lean.grad, wide.grad = grads[0].bfloat16(), grads[0].bfloat16().float()
    a.step()
    b.step()
    assert torch.equal(lean, wide.bfloat16())
    for key in ("exp_avg", "exp_avg_sq"):
        assert a.state[lean][key].dtype == torch.bfloat16
        assert torch.equal(a.state[lean][key], b.state[wide][key].bfloat16())


def _lean_config(world, stage, states=True):
    cfg = config(world, stage, dtype="bf16")
    cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=states)
    return cfg


def save_lean(rank, world, save_dir):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=_lean_config(world, 2))
    train(engine, rank, world, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, tag="t")
    return train(engine, rank, world, SAVE_AT, MORE)


def resume(rank, world, save_dir, lean, offload=False):
    cfg = _lean_config(world, 3) if lean else config(world, 1, dtype="bf16")
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    engine.load_checkpoint(save_dir, tag="t")
    dtypes = {v.dtype for s in engine.optimizer.optimizer.state.values() for k, v in s.items() if k == "exp_avg"}
    return train(engine, rank, world, SAVE_AT, MORE), dtypes


def test_checkpoints_move_between_bf16_and_fp32_states(tmp_path):
    uninterrupted = run_distributed(save_lean, 2, str(tmp_path))[0]
    lean = run_distributed(resume, 2, str(tmp_path), True)
    for losses, dtypes in lean:  # the same precision at another stage: exactly where it was
        assert dtypes == {torch.bfloat16}
        assert losses == pytest.approx(uninterrupted, abs=1e-6)
    offloaded = run_distributed(resume, 2, str(tmp_path), True, True)
    for losses, dtypes in offloaded:  # into the CPU Adam's bf16 moments: as far as its rounding goes (see above)
        assert dtypes == {torch.bfloat16}
        assert losses == pytest.approx(uninterrupted, rel=5e-4)
    full = run_distributed(resume, 1, str(tmp_path), False)
    for losses, dtypes in full:  # into fp32 masters and moments: widened, and it trains on
        assert dtypes == {torch.float32}
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, uninterrupted))


def refused_client_optimizer(rank, world, cfg):
    model = make_model()
    try:
        zeroengine.initialize(model=model, config={k: v for k, v in cfg.items() if k != "optimizer"},
                              optimizer=torch.optim.AdamW(model.parameters()))
    except ConfigError as err:
        return str(err)
    return None


def test_what_is_not_built_is_refused_by_name():
    from zeroengine.config import load_config

    states_alone = _config(2, masters=False, states=True, world=1)
    stage0 = _config(0, world=1)
    offload = _config(2, world=1)
    offload["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp"}
    sgd = _config(2, world=1)
    sgd["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    for cfg, words in ((states_alone, "bf16_optimizer_states"), (stage0, "stage 1, 2 or 3"),
                       (offload, "nvme"), (sgd, "Adam and AdamW")):
        with pytest.raises(ConfigError, match="bf16") as info:
            load_config(cfg)
        assert words in str(info.value)
    message = run_distributed(refused_client_optimizer, 1, _config(2, world=1))[0]
    assert message is not None and "bf16_master_weights_and_grads" in message
