"""offload_optimizer.delayed_update (ZeRO-Offload's DPU): each update uses gradients one step stale.

The reference is a single process that does, in plain torch, what the mode
promises: after the warm-up, step t's gradients are taken on weights that miss
update t-1 (it runs in the background meanwhile), and update t-1 reaches the
model just before update t starts. The engine must follow it step by step
(losses and weights, fp32 within 1e-5), at stages 2 and 3 on 2 ranks, with an
LR scheduler moving the rate every step (the background step must use the
rate of its own step, not the one the scheduler moved to).
"""
import copy
import threading
import time

import pytest
import torch
from parity import ADAM_EPS, delayed_update_step, make_model
from test_checkpoint_reshard import batch, config, full_state, train

import zeroengine
from zeroengine.optim.schedulers import WarmupLR
from zeroengine.testing import run_distributed

WARMUP, STEPS = 2, 6


def delayed_config(world, stage, warmup=WARMUP, ratio=1.0):
    cfg = config(world, stage, offload=ratio)
    cfg["zero_optimization"]["offload_optimizer"].update(delayed_update=True, delayed_update_warmup_steps=warmup)
    return cfg


def decaying(step: int) -> float:
    """A torch LambdaLR factor that moves the rate every step."""
    return 1.0 / (1.0 + 0.5 * step)


def reference(steps: int, warmup: int | None, torch_scheduler: bool = False, resident: frozenset = frozenset()):
    """(losses, weights the model runs on, the masters) of the stale-gradient schedule (None: no delay).
    ``resident``: parameters that land at once after the warm-up too (partial offload's accelerator buckets)."""
    model = make_model()
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
    if torch_scheduler:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, decaying)
    else:
        sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=10)
    losses = []
    for step in range(steps):
        x, y = batch(step, 0, 1)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        delayed = warmup is not None and step >= warmup
        delayed_update_step(model, master, opt, sched, delayed=delayed)
        if delayed and resident:
            with torch.no_grad():
                for (name, p), m in zip(model.named_parameters(), master.parameters()):
                    if name in resident:
                        p.copy_(m)
        losses.append(loss.item())
    return losses, state_of(model), state_of(master)


def state_of(model):
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def delayed_run(rank, world, stage, ratio=1.0, torch_scheduler=False):
    cfg = delayed_config(world, stage, ratio=ratio)
    scheduler = None
    if torch_scheduler:  # torch's schedulers wrap optimizer.step per instance: the background step must not use it
        del cfg["scheduler"]
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, decaying)  # noqa: E731
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg, lr_scheduler=scheduler)
    zero = engine.optimizer
    assert zero.delayed is not None
    losses = train(engine, rank, world, 0, STEPS)
    assert zero.delayed.pending  # the last update is still on its way to the model...
    running = full_state(engine)
    host_bytes = sum(t.numel() * t.element_size() for t in zero.delayed.held_tensors())
    offloaded = sum(zero.layout.buckets[b].chunk_numel for b in zero.delayed.buckets)
    assert host_bytes == 4 * offloaded  # one fp32 copy of the offloaded gradient shard
    zero.land_delayed_update()  # ...until it lands (save_checkpoint and destroy() do this)
    assert not zero.delayed.pending
    return losses, running, full_state(engine), resident_names(engine)


def resident_names(engine) -> frozenset:
    """The parameters in buckets kept on the accelerator (a parameter lies in one bucket)."""
    zero, names = engine.optimizer, {id(p): n for n, p in engine.module.named_parameters()}
    return frozenset(names[id(zero.flat_params.params[i])]
                     for i, b in zero.layout.bucket_of_param().items() if not zero.on_host(b))


def assert_close(actual: dict, expected: dict):
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_update_follows_the_stale_gradient_schedule(stage):
    ref_losses, ref_running, ref_master = reference(STEPS, WARMUP)
    undelayed_losses, _, _ = reference(STEPS, None)
    # the schedules differ by more than the tolerance (or this test could not tell them apart)
    assert max(abs(a - b) for a, b in zip(ref_losses, undelayed_losses)) > 1e-3
    assert ref_losses[:WARMUP + 1] == pytest.approx(undelayed_losses[:WARMUP + 1], abs=1e-6)
    for losses, running, landed, _ in run_distributed(delayed_run, 2, stage):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert_close(running, ref_running)
        assert_close(landed, ref_master)


def test_a_torch_scheduler_moves_the_rate_after_the_background_step_took_its_own():
    ref_losses, ref_running, ref_master = reference(STEPS, WARMUP, torch_scheduler=True)
    for losses, running, landed, _ in run_distributed(delayed_run, 2, 2, 1.0, True):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert_close(running, ref_running)
        assert_close(landed, ref_master)


def edit_between_steps(rank, world, stage):
    """A modifying GatheredParameters block between steps, editing nothing: the pending update must survive."""
    from zeroengine.zero import GatheredParameters

    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=delayed_config(world, stage))
    train(engine, rank, world, 0, STEPS)
    assert engine.optimizer.delayed.pending
    params = list(engine.module.parameters())
    with GatheredParameters(params[:1], modifier_rank=0):
        pass
    return full_state(engine)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_modifying_gathered_block_lands_the_update_first(stage):
    _, _, ref_master = reference(STEPS, WARMUP)
    for state in run_distributed(edit_between_steps, 2, stage):
        assert_close(state, ref_master)


def memory_rows_do_not_wait(rank, world):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=delayed_config(world, 2, warmup=0))
    delayed = engine.optimizer.delayed
    waits, real_join = [], delayed.join
    delayed.join = lambda: waits.append(delayed.creating_state) or real_join()
    train(engine, rank, world, 0, 1)  # the first delayed step creates the optimizer state: a memory row waits
    first = delayed.creating_state
    waits.clear()
    engine.memory_breakdown()
    waits_first = list(waits)
    train(engine, rank, world, 1, 2)
    waits.clear()
    engine.memory_breakdown()  # state exists: the monitor's row leaves the running step alone
    return first, waits_first, list(waits)


def test_memory_rows_wait_only_for_the_step_that_creates_optimizer_state():
    for first, waits_first, waits_later in run_distributed(memory_rows_do_not_wait, 2):
        assert first is True and waits_first == [True]
        assert waits_later == []


def test_partial_offload_delays_only_the_offloaded_buckets():
    """ratio 0.5: the buckets kept on the accelerator update at once, the offloaded ones a step late. The run
    follows that mixed schedule within the other tests' 1e-5 (fp32 rounding of CPUAdam against torch's AdamW
    over six steps stays near 1e-6), and the schedule is more than 1e-3 away from delaying every bucket and
    from delaying none (the two pure references), so neither could pass for it."""
    results = run_distributed(delayed_run, 2, 2, 0.5)
    resident = results[0][3]
    all_names = {n for n, _ in make_model().named_parameters()}
    assert resident and resident < all_names  # both kinds of bucket
    ref_losses, ref_running, ref_master = reference(STEPS, WARMUP, resident=resident)
    for pure in (reference(STEPS, WARMUP), reference(STEPS, None)):
        assert max(abs(a - b) for a, b in zip(ref_losses, pure[0])) > 1e-3
        assert max(float((ref_master[n] - pure[2][n]).abs().max()) for n in ref_master) > 1e-3
    for losses, running, landed, names in results:
        assert names == resident
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert_close(running, ref_running)
        assert_close(landed, ref_master)
    for name, value in results[0][2].items():  # and the ranks on the landed weights, exactly
        assert torch.equal(results[1][2][name], value), name


def save_resume_delayed(rank, world, stage, save_dir, resume):
    engine, _, _, _ = zeroengine.initialize(model=make_model(seed=3 if resume else 0),
                                            config=delayed_config(world, stage))
    if resume:
        engine.load_checkpoint(save_dir)
        assert engine.optimizer.steps_applied == STEPS  # the warm-up is not run again
    else:
        train(engine, rank, world, 0, STEPS)
        engine.save_checkpoint(save_dir, tag="t")  # lands the pending update first
        assert not engine.optimizer.delayed.pending
    saved = full_state(engine)
    losses = train(engine, rank, world, STEPS, 3)
    engine.optimizer.land_delayed_update()
    return saved, losses, full_state(engine)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_holds_every_update_and_resuming_equals_going_on(stage, tmp_path):
    _, _, ref_master = reference(STEPS, WARMUP)
    going_on = run_distributed(save_resume_delayed, 2, stage, str(tmp_path), False)
    resumed = run_distributed(save_resume_delayed, 2, stage, str(tmp_path), True)
    assert_close(going_on[0][0], ref_master)
    for (saved_a, losses_a, final_a), (saved_b, losses_b, final_b) in zip(going_on, resumed):
        assert_close(saved_b, saved_a)
        assert losses_b == pytest.approx(losses_a, abs=1e-6)
        assert_close(final_b, final_a)


def failing_background_step(rank, world):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=delayed_config(world, 2, warmup=0))
    engine.optimizer.optimizer.param_groups[0]["betas"] = (0.9, 2.0)  # an invalid beta: the step raises
    train(engine, rank, world, 0, 1)  # the failing step runs in the background...
    messages = []
    for attempt in (lambda: train(engine, rank, world, 1, 1),  # ...its error surfaces at the next step
                    lambda: engine.optimizer.land_delayed_update()):  # and again: nothing half-done lands
        try:
            attempt()
        except RuntimeError as error:
            messages.append((str(error), repr(error.__cause__)))
    return messages


def test_an_error_in_the_background_step_is_raised_on_the_main_thread_until_a_load():
    for messages in run_distributed(failing_background_step, 2):
        assert len(messages) == 2
        for message, cause in messages:
            assert "delayed_update" in message and "load a checkpoint" in message and "beta" in cause.lower()


FAILING_RANK, FAILING_STEP = 1, 3


def one_rank_fails(rank, world):
    """Rank 1's CPU Adam raises in the background step of step 3; every rank times step 4, which lands it."""
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=delayed_config(world, 2))
    cls, real_step = type(engine.optimizer.optimizer), type(engine.optimizer.optimizer).step
    failing = threading.Event()

    def step(self, *args, **kwargs):
        if failing.is_set() and threading.current_thread() is not threading.main_thread():
            raise FloatingPointError("injected CPU Adam failure")
        return real_step(self, *args, **kwargs)

    cls.step = step  # this worker process only
    train(engine, rank, world, 0, FAILING_STEP)
    if rank == FAILING_RANK:
        engine.optimizer.wait_delayed_update()  # step 2's background step is done: only step 3's fails
        failing.set()
    train(engine, rank, world, FAILING_STEP, 1)  # its update fails in the background, unseen so far
    start, message = time.monotonic(), None
    try:
        train(engine, rank, world, FAILING_STEP + 1, 1)  # lands it
    except Exception as error:  # noqa: BLE001 (whatever it is, the test names it)
        message = f"{type(error).__name__}: {error}"
    elapsed = time.monotonic() - start
    # Rank 1 stays up until every rank is done (a rank that exits at once breaks its peers' collective with
    # "connection closed", which would hide a peer left waiting in it until the timeout).
    zeroengine.comm.barrier()
    return message, elapsed


def test_a_background_step_failing_on_one_rank_stops_every_rank_promptly_naming_it():
    """Rank 1 must not raise alone, leaving rank 0 in the landing's all-gather until the comm timeout: every rank
    raises within seconds (the process group's timeout here is 60 s), naming rank 1 and its error."""
    for rank, (message, elapsed) in enumerate(run_distributed(one_rank_fails, 2, timeout_s=60)):
        assert message is not None, f"rank {rank} trained on"
        assert "rank 1" in message and "FloatingPointError: injected CPU Adam failure" in message, (rank, message)
        assert "rank 0" not in message and "load a checkpoint" in message, (rank, message)
        assert elapsed < 20, (rank, elapsed, message)


def test_the_config_describes_the_mode():
    cfg = zeroengine.config.load_config(delayed_config(2, 2))
    offload = cfg.zero_optimization.offload_optimizer
    assert offload.delayed_update is True and offload.delayed_update_warmup_steps == WARMUP
    bad = delayed_config(2, 2, warmup=-1)
    with pytest.raises(Exception, match="delayed_update_warmup_steps"):
        zeroengine.config.load_config(bad)


def sixteen_bit_delayed(rank, world, stage, dtype):
    from zeroengine.zero import GatheredParameters, safe_get_full_fp32_param

    cfg = config(world, stage, dtype, offload=True)
    cfg["zero_optimization"]["offload_optimizer"].update(delayed_update=True, delayed_update_warmup_steps=1)
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
    losses = train(engine, rank, world, 0, 4)
    engine.optimizer.land_delayed_update()
    params = list(engine.module.parameters())
    masters = [safe_get_full_fp32_param(p) for p in params]
    with GatheredParameters(params):
        mismatched = [i for i, (p, m) in enumerate(zip(params, masters)) if not torch.equal(p.data, m.to(p.dtype))]
    return losses, mismatched, engine.optimizer.steps_applied


@pytest.mark.parametrize("stage,dtype", [(2, "bf16"), (3, "fp16")])
def test_16bit_landing_writes_the_masters_in_the_model_dtype(stage, dtype):
    """The delayed step writes fp32 masters; landing converts them on the way into the 16-bit model (fp16:
    the background step unscaled the gradients by the step's own loss scale)."""
    for losses, mismatched, applied in run_distributed(sixteen_bit_delayed, 2, stage, dtype):
        assert all(torch.isfinite(torch.tensor(losses))) and applied >= 3
        assert mismatched == []
