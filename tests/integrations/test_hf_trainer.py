"""Hugging Face's Trainer, unchanged, on zeroengine through ZEROENGINE_AS_DEEPSPEED: the docs' ZeRO-2 and ZeRO-3
templates, gradient accumulation 2, a tiny random GPT-2 on CPU/gloo (scripts/hf_trainer_run.py).

At one rank the per-step loss and grad norm equal the plain Trainer's (same optimizer and schedule) within
1e-5 relative; checkpoints are ``checkpoint-N/global_stepN`` + ``latest``; a fresh process resuming from one
reproduces the later steps exactly, on the same rank count, and within rounding on the other (the global
batch kept: micro-batch 2 x accumulation 4 at one rank is 2 x 2 x 2 ranks)."""
import json
import shutil

import pytest
from runner import config, for_module, launch, read, relative_difference, script

from zeroengine.testing import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(780)]  # a test waits for up to 3 runs in a row, 240 s each
TRAINER = script("hf_trainer_run.py")
SAVE_STEPS = 3


def _train(runs, tmp, name, how, procs, stage=None, resume_from=None, grad_accum=2, deepspeed=None, *flags):
    out = tmp / name
    if resume_from is not None:  # a copy of the run that saved it, without its later checkpoints
        shutil.copytree(resume_from.parent, out)
        for later in out.glob("checkpoint-*"):
            if later.name != resume_from.name:
                shutil.rmtree(later)
    argv = [TRAINER, "--output_dir", str(out), "--report", str(tmp / f"{name}.json"), "--grad_accum", str(grad_accum),
            "--save_steps", str(SAVE_STEPS)]
    if stage is not None:
        argv += ["--deepspeed", deepspeed or config(f"hf_zero{stage}.json")]
    argv += list(flags)
    if resume_from is not None:
        argv += ["--resume", str(out / resume_from.name)]
    port = free_port() if how == "zeroengine" else None  # (runs overlap: each launcher job its own port)
    runs.start(launch(how, procs, argv, port=port), switch=stage is not None and how != "zeroengine").wait()
    return read(tmp / f"{name}.json"), out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


def _no_optimizer_config(tmp):
    """The ZeRO-3 template without its optimizer and scheduler sections."""
    with open(config("hf_zero3.json")) as f:
        template = json.load(f)
    del template["optimizer"], template["scheduler"]
    path = tmp / "zero3_no_optimizer.json"
    path.write_text(json.dumps(template))
    return str(path)


# Every run of the module, by name: (what it runs after, the run). Runs overlap (most of a run is one process
# importing torch and transformers, one core busy): each starts once those it resumes from have ended; those the
# selected tests need are all scheduled at the first test, and each test waits for its own.
RUNS = {
    "plain": ((), lambda r, t: _train(r, t, "plain", "python", 1)),
    "zero2": ((), lambda r, t: _train(r, t, "zero2", "torchrun", 1, 2)),
    "zero3": ((), lambda r, t: _train(r, t, "zero3", "torchrun", 1, 3)),
    "two_ranks": ((), lambda r, t: _train(r, t, "zero2_two_ranks", "zeroengine", 2, stage=2)),
    "zero3_resumed": (("zero3",), lambda r, t: _train(r, t, "zero3_resumed", "zeroengine", 1, stage=3,
                                                      resume_from=t / "zero3" / "checkpoint-3")),
    "two_ranks_resumed": (("two_ranks",), lambda r, t: _train(
        r, t, "zero2_two_ranks_resumed", "zeroengine", 2, stage=2, resume_from=t / "zero2_two_ranks" / "checkpoint-3")),
    "two_ranks_resumed_on_one": (("two_ranks",), lambda r, t: _train(
        r, t, "zero2_one_rank_resumed", "torchrun", 1, stage=2, resume_from=t / "zero2_two_ranks" / "checkpoint-3",
        grad_accum=4)),
    "zero3_resumed_on_two": (("zero3",), lambda r, t: _train(
        r, t, "zero3_two_ranks_resumed", "torchrun", 2, stage=3, resume_from=t / "zero3" / "checkpoint-3",
        grad_accum=1)),
    "plain_trainer_optimizer": ((), lambda r, t: _train(r, t, "plain_trainer_optimizer", "python", 1, None, None, 2,
                                                         None, "--trainer_optimizer")),
    "zero3_trainer_optimizer": ((), lambda r, t: _train(r, t, "zero3_trainer_optimizer", "torchrun", 1, 3, None, 2,
                                                         _no_optimizer_config(t))),
}
NEEDS = {
    "test_one_rank_matches_the_plain_trainer": ("plain", "zero2", "zero3"),
    "test_resuming_reproduces_the_later_steps_exactly": ("zero3", "zero3_resumed"),
    "test_two_ranks_through_the_launcher_resume_exactly_and_on_one_rank": (
        "two_ranks", "two_ranks_resumed", "two_ranks_resumed_on_one"),
    "test_a_one_rank_checkpoint_resumes_on_two_ranks_through_torchrun": ("zero3", "zero3_resumed_on_two"),
    "test_a_config_without_optimizer_and_scheduler_trains_with_the_trainers_own": (
        "plain_trainer_optimizer", "zero3_trainer_optimizer"),
}


@pytest.fixture(scope="module")
def runs(request, tmp):
    """``runs(name)``: that run's (report, output folder)."""
    scheduled = for_module(request, RUNS, lambda item: NEEDS.get(item.originalname, ()), tmp)
    yield scheduled
    scheduled.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_matches_the_plain_trainer(runs, stage):
    plain = runs("plain")[0]
    report, out = runs(f"zero{stage}")
    assert report["wrapped"] == "zeroengine.engine.Engine" and plain["wrapped"].endswith("GPT2LMHeadModel")
    assert report["steps"] == plain["steps"] == [1, 2, 3, 4, 5, 6]
    assert relative_difference(plain["loss"], report["loss"]) < 1e-5
    assert relative_difference(plain["grad_norm"], report["grad_norm"]) < 1e-5
    for step in (3, 6):
        checkpoint = out / f"checkpoint-{step}"
        assert (checkpoint / f"global_step{step}").is_dir()
        assert (checkpoint / "latest").read_text().strip() == f"global_step{step}"
        assert (checkpoint / "model.safetensors").stat().st_size > 0


def test_resuming_reproduces_the_later_steps_exactly(runs):
    report, _ = runs("zero3")
    resumed, _ = runs("zero3_resumed")  # from zero3's checkpoint-3
    assert resumed["steps"] == report["steps"] and resumed["loss"] == report["loss"]
    assert resumed["grad_norm"][SAVE_STEPS:] == report["grad_norm"][SAVE_STEPS:]


def test_two_ranks_through_the_launcher_resume_exactly_and_on_one_rank(runs):
    report, _ = runs("two_ranks")
    assert report["world"] == 2 and report["wrapped"] == "zeroengine.engine.Engine"
    same, _ = runs("two_ranks_resumed")  # from its checkpoint-3, on 2 ranks through the launcher
    assert same["loss"] == report["loss"] and same["grad_norm"] == report["grad_norm"]
    other, _ = runs("two_ranks_resumed_on_one")  # from its checkpoint-3, on 1 rank through torchrun, accumulating 4
    assert other["world"] == 1
    assert relative_difference(report["loss"][SAVE_STEPS:], other["loss"][SAVE_STEPS:]) < 1e-5
    assert relative_difference(report["grad_norm"][SAVE_STEPS:], other["grad_norm"][SAVE_STEPS:]) < 1e-5


def test_a_one_rank_checkpoint_resumes_on_two_ranks_through_torchrun(runs):
    report, _ = runs("zero3")
    two, _ = runs("zero3_resumed_on_two")  # from zero3's checkpoint-3, on 2 ranks, accumulating 1
    assert two["world"] == 2
    assert relative_difference(report["loss"][SAVE_STEPS:], two["loss"][SAVE_STEPS:]) < 1e-5
    assert relative_difference(report["grad_norm"][SAVE_STEPS:], two["grad_norm"][SAVE_STEPS:]) < 1e-5


def test_a_config_without_optimizer_and_scheduler_trains_with_the_trainers_own(runs):
    """The Trainer's own AdamW and linear schedule, built by the Trainer and handed to the engine (the ZeRO-3
    template without its optimizer and scheduler sections)."""
    plain = runs("plain_trainer_optimizer")[0]
    ours = runs("zero3_trainer_optimizer")[0]
    assert relative_difference(plain["loss"], ours["loss"]) < 1e-5
    assert relative_difference(plain["grad_norm"], ours["grad_norm"]) < 1e-5
