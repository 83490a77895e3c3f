"""Pipeline parallelism (zeroengine.pipe) against one process training the same layers on the same global batch.

Each run trains a small language model (an embedding tied to the LM head, residual MLP blocks) split into
2 or 4 stages, 4-8 micro-batches per step, under GPipe, 1F1B and interleaved 1F1B (2 or 3 model chunks
per stage), alone and with data parallelism at ZeRO stages 0 and 1. The reference is the same PipelineModule at one stage in one process, stepping a torch
AdamW on the mean loss of every replica's micro-batches. fp32 results must agree within 1e-5 (what differs
is only the order in which the tied weight's two gradients and the replicas' gradients are summed).
"""
import os

import pytest
import torch
from pipe_models import batches, config, layers, lm_loss, pipe_model, reference

import zeroengine
from zeroengine.config import ConfigError
from zeroengine.pipe import PipelineModule
from zeroengine.testing import run_distributed

STEPS = 3


def train(rank, world, stages, micro_batches, stage=1, schedule="1f1b", dtype="fp32", steps=STEPS, model_kwargs=None,
          save=None, load=None, data_seed=3, offload=False):
    dp = world // stages
    cfg = config(dp, micro_batches, stage=stage, schedule=schedule, dtype=dtype)
    if offload:  # the optimizer state in CPU memory, stepped by the C++ Adam
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zeroengine.initialize(model=pipe_model(stages, **(model_kwargs or {})), config=cfg)
    if load:
        engine.load_checkpoint(load)
    losses = []
    for per_rank in batches(steps, micro_batches, dp, seed=data_seed):
        losses.append(float(engine.train_batch(iter(per_rank[engine.mesh.dp_rank]))))
    if save:
        engine.save_checkpoint(save, tag="pipe")
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "state": state, "stats": engine.pipe_stats, "stage": engine.stage_id,
            "norm": engine.get_global_grad_norm()}


def merged_state(results):
    state = {}
    for r in results:
        for k, v in r["state"].items():
            if k in state:  # a tied weight: every stage's copy is the owner's
                assert torch.equal(state[k], v), k
            state[k] = v
    return state


def assert_matches(results, ref_losses, ref_state, tol=1e-5, loss_rel=None):
    for r in results:  # every stage reports the step's loss
        assert r["losses"] == pytest.approx(ref_losses, abs=tol if loss_rel is None else 0, rel=loss_rel)
    state = merged_state(results)
    assert set(state) == set(ref_state)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k].float(), atol=tol, rtol=0, msg=k)


@pytest.mark.parametrize("stages,world,micro_batches,stage,schedule", [
    (2, 2, 4, 1, "1f1b"), (2, 2, 4, 1, "gpipe"), (4, 4, 8, 1, "1f1b"), (4, 4, 8, 0, "gpipe"),
    (2, 4, 4, 1, "1f1b"), (2, 4, 4, 0, "gpipe"),
])
def test_pipeline_matches_one_process(stages, world, micro_batches, stage, schedule):
    results = run_distributed(train, world, stages, micro_batches, stage=stage, schedule=schedule)
    ref_losses, ref_state = reference(STEPS, micro_batches, world // stages)
    assert_matches(results, ref_losses, ref_state)
    # the gradient norm (clipped at 1.0) adds up over the stages: every rank reports the same one
    assert len({r["norm"] for r in results}) == 1 and results[0]["norm"] > 1.0


def test_untied_model_with_tuple_activations_and_recompute():
    """Stages pass (hidden, mask) tuples, a mask needing no gradient; every 2 layers are recomputed."""
    kwargs = {"masked": True, "partition_method": "parameters", "activation_checkpoint_interval": 2}
    results = run_distributed(train, 4, 4, 6, schedule="1f1b", model_kwargs=kwargs)
    ref_losses, ref_state = reference(STEPS, 6, 1, masked=True, partition_method="parameters")
    assert_matches(results, ref_losses, ref_state)


@pytest.mark.parametrize("stages,world,micro_batches,stage,schedule,chunks,offload", [
    (2, 2, 4, 1, "interleaved", 2, False), (2, 2, 4, 0, "1f1b", 3, False), (4, 4, 8, 1, "interleaved", 2, False),
    (2, 4, 4, 1, "interleaved", 2, True),
])
def test_interleaved_pipeline_matches_one_process(stages, world, micro_batches, stage, schedule, chunks, offload):
    """v model chunks per stage: a micro-batch crosses the ranks v times (at 2 stages both ways between the
    same two ranks), the tied embedding lives on the first chunk of stage 0 and the head on the last chunk
    of the last stage; the numbers are the one-process ones (also with dp=2 and the optimizer offloaded)."""
    kwargs = {"virtual_stages": chunks}
    results = run_distributed(train, world, stages, micro_batches, stage=stage, schedule=schedule,
                              model_kwargs=kwargs, offload=offload)
    ref_losses, ref_state = reference(STEPS, micro_batches, world // stages)
    # The C++ Adam rounds differently from torch's AdamW (fused multiply-adds, its own order): the weights still
    # agree within 1e-5, and the losses (about 10 here, where an fp32 ulp is 1e-6) within 2e-6 of their size.
    assert_matches(results, ref_losses, ref_state, loss_rel=2e-6 if offload else None)
    assert len({r["norm"] for r in results}) == 1 and results[0]["norm"] > 1.0
    # chunk-passes in flight: the warm-up, 2(p-s-1) + (v-1)p, plus one
    expected = {s: min(2 * (stages - s - 1) + (chunks - 1) * stages + 1, micro_batches * chunks)
                for s in range(stages)}
    assert {r["stage"]: r["stats"]["max_in_flight"] for r in results} == expected


def test_interleaved_recompute_and_checkpoint_to_a_plain_layout(tmp_path):
    """Recomputed layers per chunk; the checkpoint of 2 stages × 2 chunks loads at one stage and at 2 stages
    without chunks, exactly (the layers keep their names)."""
    kwargs = {"virtual_stages": 2, "activation_checkpoint_interval": 1}
    save = str(tmp_path)
    results = run_distributed(train, 2, 2, 4, schedule="interleaved", model_kwargs=kwargs, save=save)
    ref_losses, ref_state = reference(STEPS, 4, 1)
    assert_matches(results, ref_losses, ref_state)
    saved = merged_state(results)
    for stages in (1, 2):
        loaded = merged_state(run_distributed(train, stages, stages, 4, steps=0, load=save))
        assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_activations_held_per_stage(schedule):
    """1F1B holds at most p - s micro-batches on stage s; GPipe holds all m."""
    stages, m = 4, 8
    results = run_distributed(train, 4, stages, m, schedule=schedule, steps=1)
    held = {r["stage"]: r["stats"]["max_in_flight"] for r in results}
    expected = {s: (min(stages - s, m) if schedule == "1f1b" else m) for s in range(stages)}
    assert held == expected


def test_bf16_pipeline_follows_the_fp32_reference():
    """bf16 at 2 stages × 2 replicas: the same trajectory as fp32 up to bf16 rounding. The weights are stored in
    bf16 (8 significant bits: a relative error of 2^-9 per rounding), so after 3 AdamW steps of lr 1e-2 the
    weights may differ from the fp32 run by a few bf16 ulps of their size (|w| < 4 here: 2^-6 per ulp), and the
    losses (about 10) by a few per cent. A pipeline that dropped a micro-batch or a stage's gradient would
    miss by far more: each step moves the loss by 0.3 to 4."""
    results = run_distributed(train, 4, 2, 4, stage=1, dtype="bf16")
    ref_losses, ref_state = reference(STEPS, 4, 2)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=0.03)
    state = merged_state(results)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], atol=0.08, rtol=0.02, msg=k)


def test_checkpoint_saved_at_dp2_pp2_loads_at_other_layouts(tmp_path):
    """Saved by 2 stages × 2 replicas at ZeRO 1; loaded into 1 rank, 4 stages, and 2 stages at ZeRO 0: the
    weights come back exactly, and one more step from there equals the original layout's next step."""
    save = str(tmp_path)
    saved = merged_state(run_distributed(train, 4, 2, 4, steps=2, save=save))
    after_original = run_distributed(train, 4, 2, 4, steps=1, load=save, data_seed=9)
    for stages, world, stage in [(1, 1, 1), (4, 4, 1), (2, 2, 0)]:
        loaded = merged_state(run_distributed(train, world, stages, 4, stage=stage, steps=0, load=save))
        assert all(torch.equal(loaded[k], saved[k]) for k in saved) and set(loaded) == set(saved)
    # one more step at 1 rank (the same global batch: 4 micro-batches x 2 replicas = 8 micro-batches)
    one_rank = run_distributed(_one_rank_step, 1, save)
    assert one_rank[0] == pytest.approx(after_original[0]["losses"][0], abs=1e-5)


def _one_rank_step(rank, world, save):
    engine, *_ = zeroengine.initialize(model=pipe_model(1), config=config(1, 8, stage=1))
    engine.load_checkpoint(save)
    two_replicas = batches(1, 4, 2, seed=9)[0]
    return float(engine.train_batch(iter(two_replicas[0] + two_replicas[1])))


def test_ze_to_fp32_consolidates_a_pipeline_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    saved = merged_state(run_distributed(train, 4, 4, 4, steps=1, save=save))
    out = str(tmp_path / "model.pt")
    assert os.system(f"ze_to_fp32 {save} {out} --tag pipe > /dev/null 2>&1") == 0
    state = torch.load(out)
    model = pipe_model(1)
    model.load_state_dict(state)  # the one-stage model takes it as is
    assert set(state) == set(saved) and all(torch.equal(state[k].float(), saved[k]) for k in saved)


# -- errors ----------------------------------------------------------------------------------------------------

def _errors(rank, world):
    problems = {}
    cfg = config(1, 4, stage=2)
    try:
        zeroengine.initialize(model=pipe_model(2), config=cfg)
    except ConfigError as err:
        problems["stage2"] = str(err)
    cfg = config(1, 4)
    cfg["pipeline"]["stages"] = 4
    try:
        zeroengine.initialize(model=pipe_model(2), config=cfg)
    except ConfigError as err:
        problems["stages"] = str(err)
    engine, *_ = zeroengine.initialize(model=pipe_model(2), config=config(1, 4))
    try:
        engine(torch.zeros(2, 6, dtype=torch.long))
    except RuntimeError as err:
        problems["forward"] = str(err)
    try:
        engine.train_batch(iter(batches(1, 4, 1)[0][0][:3]))
    except ValueError as err:
        problems["short"] = str(err)
    for name, model, cfg in [("interleaved_v1", pipe_model(2), config(1, 4, schedule="interleaved")),
                             ("gpipe_v2", pipe_model(2, virtual_stages=2), config(1, 4, schedule="gpipe")),
                             ("uneven_v2", pipe_model(2, virtual_stages=2), config(1, 3))]:
        try:
            zeroengine.initialize(model=model, config=cfg)
        except ConfigError as err:
            problems[name] = str(err)
    zeroengine.comm.barrier()  # (the last module made groups: no rank closes the store while another makes one)
    return problems


def test_errors_name_the_problem():
    problems = run_distributed(_errors, 2)[0]
    assert "zero_optimization.stage" in problems["stage2"] and "stages 0 and 1" in problems["stage2"]
    assert "pipeline.stages" in problems["stages"] and "num_stages=2" in problems["stages"]
    assert "train_batch" in problems["forward"]
    assert "ran out at micro-batch 3" in problems["short"]
    assert "pipeline.schedule" in problems["interleaved_v1"] and "virtual_stages > 1" in problems["interleaved_v1"]
    assert "pipeline.schedule" in problems["gpipe_v2"] and "virtual_stages=2" in problems["gpipe_v2"]
    assert "gradient_accumulation_steps" in problems["uneven_v2"] and "multiple of 2" in problems["uneven_v2"]


def _uneven(rank, world):
    try:
        PipelineModule(layers(), num_stages=2)
    except ValueError as err:
        return str(err)


def test_world_not_divisible_by_stages():
    assert "must divide the world size" in run_distributed(_uneven, 3)[0]


def test_virtual_stages_need_more_than_one_stage():
    with pytest.raises(ValueError, match="nothing to interleave"):
        PipelineModule(layers(), num_stages=1, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages must be an integer >= 1"):
        PipelineModule(layers(), num_stages=1, virtual_stages=0)


def test_one_stage_in_one_process_needs_no_world():
    model = PipelineModule(layers(), num_stages=1, loss_fn=lm_loss)
    x, y = batches(1, 1, 1)[0][0][0]
    assert model.stage_layers == list(range(len(layers()))) and lm_loss(model(x), y).dim() == 0


def _eval(rank, world, stages, chunks=1):
    engine, *_ = zeroengine.initialize(model=pipe_model(stages, virtual_stages=chunks),
                                       config=config(world // stages, 4))
    data = batches(1, 4, world // stages)[0][engine.mesh.dp_rank]
    loss = float(engine.eval_batch(iter(data)))
    losses, logits = engine.eval_batch(iter(data), return_logits=True, reduce_output=None)
    trained = float(engine.train_batch(iter(data)))
    return {"loss": loss, "each": None if losses is None else [float(x) for x in losses],
            "logits": None if logits is None else len(logits), "trained": trained, "training": engine.module.training}


@pytest.mark.parametrize("chunks", [1, 2])
def test_eval_batch_is_the_forward_of_train_batch(chunks):
    """eval_batch's mean loss on every stage equals the one-process forward; with reduce_output=None the last
    stage returns each micro-batch's loss and, with return_logits, its outputs; the next train_batch starts from
    the same weights (its loss is the same). Also with 2 model chunks per stage."""
    results = run_distributed(_eval, 4, 2, chunks)
    model = pipe_model(1).eval()
    per_replica = batches(1, 4, 2)[0]
    with torch.no_grad():
        expected = [[lm_loss(model(x), y).item() for x, y in replica] for replica in per_replica]
    mean = sum(map(sum, expected)) / 8
    for r in results:
        assert r["loss"] == pytest.approx(mean, abs=1e-5) and r["trained"] == pytest.approx(mean, abs=1e-5)
        assert r["training"]
    last = [r for r in results if r["logits"] is not None]
    assert len(last) == 2 and all(r["logits"] == 4 for r in last)
    # each micro-batch's loss, averaged over the two replicas
    assert results[0]["each"] == pytest.approx([(a + b) / 2 for a, b in zip(*expected)], abs=1e-5)
