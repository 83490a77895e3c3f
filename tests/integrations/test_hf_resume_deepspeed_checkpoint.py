"""A Hugging Face Trainer run started under real DeepSpeed resumes under zeroengine (ZEROENGINE_AS_DEEPSPEED):
``resume_from_checkpoint`` pointing at DeepSpeed's ``checkpoint-3/`` (global_step3, latest, the Trainer's
own files) continues exactly where DeepSpeed continues.

The docs' ZeRO-2 template, without its CPU optimizer offload (DeepSpeed's CPU Adam would be JIT-built for
minutes) and with ``torch_adam`` (both engines then step torch's AdamW); DeepSpeed 0.19.8 is the test anchor
scripts/install.sh puts in .deepspeed_anchor."""
import json
import os
import shutil
import subprocess

import pytest
from runner import config, environment, launch, read, relative_difference, run, script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ANCHOR = os.path.join(REPO, ".deepspeed_anchor")
TRAINER = script("hf_trainer_run.py")
REAL_DEEPSPEED = script("real_deepspeed_run.py")  # the same script, DeepSpeed without its shm op's JIT build
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _argv(out, report, cfg, *extra) -> list[str]:
    return [TRAINER, "--output_dir", str(out), "--report", str(report), "--grad_accum", "2", "--save_steps", "3",
            "--deepspeed", str(cfg), *extra]


def test_a_deepspeed_trainer_checkpoint_resumes_under_zeroengine(tmp_path):
    if not os.path.isfile(os.path.join(ANCHOR, "deepspeed", "__init__.py")):
        pytest.fail(f"the DeepSpeed 0.19.8 test anchor is missing from {ANCHOR}: scripts/install.sh installs it")
    with open(config("hf_zero2.json")) as f:
        cfg = json.load(f)
    del cfg["zero_optimization"]["offload_optimizer"]
    cfg["optimizer"]["params"]["torch_adam"] = True
    cfg_path = tmp_path / "zero2.json"
    cfg_path.write_text(json.dumps(cfg))

    # real DeepSpeed: 6 steps, checkpoints at 3 and 6
    env = environment(False)
    env.update(PYTHONPATH=os.pathsep.join([ANCHOR, env["PYTHONPATH"]]), DS_ACCELERATOR="cpu")
    command = launch("torchrun", 1, [REAL_DEEPSPEED, *_argv(tmp_path / "ds", tmp_path / "ds.json", cfg_path)])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    theirs = read(tmp_path / "ds.json")
    assert theirs["wrapped"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert os.path.isfile(tmp_path / "ds" / "checkpoint-3" / "global_step3" / "mp_rank_00_model_states.pt")

    # zeroengine under the alias resumes from DeepSpeed's checkpoint-3 (a copy without checkpoint-6)
    shutil.copytree(tmp_path / "ds" / "checkpoint-3", tmp_path / "ze" / "checkpoint-3")
    run(launch("torchrun", 1, _argv(tmp_path / "ze", tmp_path / "ze.json", cfg_path, "--resume",
                                    str(tmp_path / "ze" / "checkpoint-3"))), switch=True)
    ours = read(tmp_path / "ze.json")
    assert ours["wrapped"] == "zeroengine.engine.Engine"
    assert ours["steps"] == theirs["steps"] == [1, 2, 3, 4, 5, 6]
    # steps 1-3 are the Trainer's log history from the checkpoint; 4-6 were trained by zeroengine
    assert relative_difference(ours["loss"][3:], theirs["loss"][3:]) < 1e-5
    assert relative_difference(ours["grad_norm"][3:], theirs["grad_norm"][3:]) < 1e-5
