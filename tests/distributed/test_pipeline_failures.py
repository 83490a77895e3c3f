"""A pipeline stage that fails stops every rank promptly, with the failing rank and its error named, and the
next train_batch starts clean (no message of the failed step left behind, no stale send waited on).

Each run trains one good step, then a step that fails on one rank (its data iterator runs out, or its loss
is not a scalar), then the remaining good steps; the result must equal one process trained on the good
steps alone: the failed step leaves no trace."""
import time

import pytest
import torch
from pipe_models import batches, config, lm_loss, pipe_model, reference
from test_pipeline import assert_matches

import zeroengine
from zeroengine.pipe.engine import PipelineError
from zeroengine.testing import run_distributed

GOOD_STEPS = 3
BOUND_S = 60  # the harness's and the process group's timeout: a hang fails the test well before pytest's


class LossFailingOnce:
    """lm_loss, except for one call, which returns the per-token losses (not a scalar)."""

    def __init__(self, failing_call: int):
        self.calls, self.failing_call = 0, failing_call

    def __call__(self, logits, labels):
        self.calls += 1
        if self.calls == self.failing_call:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     reduction="none")
        return lm_loss(logits, labels)


def train_with_a_failed_step(rank, world, stages, micro_batches, failure, failing_rank, chunks=1, schedule="1f1b"):
    dp = world // stages
    model = pipe_model(stages, virtual_stages=chunks)
    engine, *_ = zeroengine.initialize(model=model, config=config(dp, micro_batches, schedule=schedule))
    data = batches(GOOD_STEPS, micro_batches, dp)
    mine = [step[engine.mesh.dp_rank] for step in data]
    if failure == "loss" and rank == failing_rank:  # its third micro-batch of the second step
        model.loss_fn = LossFailingOnce(micro_batches + 3)
    losses = [float(engine.train_batch(iter(mine[0])))]
    failing_iter = iter(mine[1][:2]) if failure == "data" and rank == failing_rank else iter(mine[1])
    start = time.perf_counter()
    with pytest.raises(Exception) as caught:
        engine.train_batch(failing_iter)
    elapsed = time.perf_counter() - start
    for step in mine[1:]:
        losses.append(float(engine.train_batch(iter(step))))
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "state": state, "error": caught.value, "elapsed": elapsed,
            "global_steps": engine.global_steps}


def check(results, world, stages, micro_batches, failing_rank, own_error):
    ref_losses, ref_state = reference(GOOD_STEPS, micro_batches, world // stages)
    assert_matches(results, ref_losses, ref_state)
    for rank, r in enumerate(results):
        assert r["global_steps"] == GOOD_STEPS
        assert r["elapsed"] < 20, f"rank {rank} took {r['elapsed']:.1f} s to learn of the failure"
        if rank == failing_rank:
            assert isinstance(r["error"], ValueError) and own_error in str(r["error"])
        else:
            assert isinstance(r["error"], PipelineError), r["error"]
            assert f"rank {failing_rank} failed" in str(r["error"]) and own_error in str(r["error"])


@pytest.mark.parametrize("world,stages,failing_rank", [(2, 2, 0), (4, 4, 0)])
def test_the_first_stage_running_out_of_data_stops_every_stage(world, stages, failing_rank):
    results = run_distributed(train_with_a_failed_step, world, stages, 4, "data", failing_rank, timeout_s=BOUND_S)
    check(results, world, stages, 4, failing_rank, "the data iterator ran out at micro-batch 2")


@pytest.mark.parametrize("world,stages,chunks,failing_rank", [(4, 4, 1, 3), (2, 2, 2, 1)])
def test_a_non_scalar_loss_on_the_last_stage_stops_every_stage(world, stages, chunks, failing_rank):
    schedule = "interleaved" if chunks > 1 else "1f1b"
    results = run_distributed(train_with_a_failed_step, world, stages, 4, "loss", failing_rank, chunks, schedule,
                              timeout_s=BOUND_S)
    check(results, world, stages, 4, failing_rank, "must produce a scalar loss")


def test_a_failure_in_one_pipeline_line_stops_the_other_replicas():
    """dp2 × pp2: the replica whose stages all succeeded stops too (it would otherwise wait in the data-parallel
    reduction for ranks that left)."""
    results = run_distributed(train_with_a_failed_step, 4, 2, 4, "data", 2, timeout_s=BOUND_S)
    check(results, 4, 2, 4, 2, "the data iterator ran out at micro-batch 2")
