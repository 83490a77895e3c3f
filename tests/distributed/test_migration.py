"""A DeepSpeed-style script runs on zeroengine by switching its import and its launcher, nothing else.

tests/migration/ds_style_train.py is written for DeepSpeed (``import deepspeed``); each test here
rewrites that one line to ``import zeroengine as deepspeed`` and starts it with the ``zeroengine``
launcher using DeepSpeed's own flags (``--num_gpus 2 ... --deepspeed --deepspeed_config FILE``).
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import zeroengine
from zeroengine.testing import free_port, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIGRATION = os.path.join(REPO, "tests", "migration")
LAUNCHER = [sys.executable, "-m", "zeroengine.launcher.main"]
LOSS_LINE = re.compile(r"^LOSS (\d+) ([0-9.]+) ", re.M)
# above two launcher runs of 300 s each (one test resumes a run), so a hang fails naming the command
pytestmark = pytest.mark.timeout(660)


def _switched_script(tmp_path) -> str:
    """The DeepSpeed script with its one import line switched; everything else byte for byte."""
    with open(os.path.join(MIGRATION, "ds_style_train.py")) as f:
        original = f.read()
    lines = original.splitlines(keepends=True)
    imports = [i for i, line in enumerate(lines) if re.match(r"\s*(import|from)\s+deepspeed\b", line)]
    assert [lines[i] for i in imports] == ["import deepspeed\n"], "the script must import DeepSpeed in one line"
    lines[imports[0]] = "import zeroengine as deepspeed\n"
    path = tmp_path / "ds_style_train.py"
    path.write_text("".join(lines))
    return str(path)


def _launch(script, config, *args) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = LAUNCHER + ["--num_gpus", "2", "--master_port", str(free_port()), script,
                      "--deepspeed", "--deepspeed_config", os.path.join(MIGRATION, config)] + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


def _losses(text) -> dict:
    return {int(step): float(value) for step, value in LOSS_LINE.findall(text)}


def _assert_falls(losses: dict) -> None:
    steps = sorted(losses)
    first = sum(losses[s] for s in steps[:3]) / 3
    last = sum(losses[s] for s in steps[-3:]) / 3
    assert last < first - 0.1, losses


def test_ds_script_trains_at_stage3_with_zero_init_and_resumes_at_stage2(tmp_path):
    """Stage 3 + zero.Init + GatheredParameters + activation checkpointing, a checkpoint with
    client_state at step 6; then the stage-2 config resumes it and continues on the same numbers."""
    script = _switched_script(tmp_path)
    save_dir = str(tmp_path / "ckpt")
    first = _launch(script, "ds_config_stage3.json", "--steps", "12", "--save_dir", save_dir, "--save_at", "6")
    losses = _losses(first)
    assert sorted(losses) == list(range(1, 13)), first[-3000:]
    _assert_falls(losses)
    assert os.path.isfile(os.path.join(save_dir, "latest"))

    # The script skips what the checkpointed run consumed, as a DeepSpeed script must (DeepSpeed's loader starts its
    # epoch over); zeroengine's loader resumes where the checkpoint stopped, so the resume turns that off
    # (docs/migrating-from-deepspeed.md; without it zeroengine warns that the data is skipped twice).
    with open(os.path.join(MIGRATION, "ds_config.json")) as f:
        config = json.load(f)
    config["checkpoint"] = {"resume_data_position": False}
    restart_config = tmp_path / "ds_config_epoch_over.json"
    restart_config.write_text(json.dumps(config))
    resumed = _launch(script, str(restart_config), "--steps", "12", "--save_dir", save_dir, "--resume")
    assert 'RESUMED {"note": "ds-style", "step": 6}' in resumed, resumed[-3000:]
    after = _losses(resumed)
    assert sorted(after) == list(range(7, 13)), resumed[-3000:]
    # Same weights, optimizer state, scheduler position and data: the continuation matches the
    # uninterrupted run up to the rounding difference between stage 3 and stage 2 reductions.
    for step in range(7, 13):
        assert after[step] == pytest.approx(losses[step], abs=1e-5), (step, after[step], losses[step])


def test_ds_script_trains_a_moe_layer_with_expert_parallelism(tmp_path):
    losses = _losses(_launch(_switched_script(tmp_path), "ds_config_moe.json", "--steps", "10", "--moe"))
    assert sorted(losses) == list(range(1, 11))
    _assert_falls(losses)


def _params_after_initialize(rank, world, stage):
    torch.manual_seed(rank)  # each rank builds different initial values
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    zeroengine.initialize(model=model, config=config)
    with zeroengine.zero.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_makes_rank0_initial_parameters_authoritative(stage):
    """DeepSpeed broadcasts the module's parameters from rank 0 when the engine is built, so e.g. an
    edit made on rank 0 only before initialize() reaches every rank, at every stage."""
    ranks = run_distributed(_params_after_initialize, 2, stage)
    torch.manual_seed(0)
    expected = [p.detach() for p in torch.nn.Linear(4, 2).parameters()]
    for params in ranks:
        for got, want in zip(params, expected):
            assert torch.equal(got, want)
