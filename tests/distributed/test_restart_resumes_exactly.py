"""``zeroengine --max_restarts 2``: a rank killed mid-run (after a checkpoint) restarts the job, every stage
resumes from its checkpoint (weights, optimizer, schedule and the data loader's position), and the final
parameters equal an uninterrupted run's bit for bit, at ZeRO stages 0-3 (tests/launcher_scripts/restart_train.py:
13 samples over 2 ranks, 9 steps, so the kill lands mid-epoch and the run crosses epochs). (Without
--max_restarts a failed rank stops the job with its code: tests/unit/test_launcher_restarts.py.) Without the
data loader's position in the checkpoint this fails at stage 1: the restarted epoch trains other samples."""
import os
import subprocess
import sys

import pytest
import torch

from zeroengine.testing import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "launcher_scripts", "restart_train.py")
STEPS, CRASH_AT = 9, 5
pytestmark = pytest.mark.timeout(600)


def _launch(out, launcher_flags=(), script_flags=()):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "zeroengine.launcher.main", "--num_procs", "2", "--master_port",
                           str(free_port()), *launcher_flags, SCRIPT, str(out), str(STEPS), *script_flags], env=env,
                          capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    _launch(tmp_path / "whole")
    done = _launch(tmp_path / "killed", ["--max_restarts", "2"], ["--crash_at", str(CRASH_AT)])
    assert "rank 1 failed (exit code 1); restarting every rank of the job: restart 1 of 2" in done.stderr
    for stage in range(4):
        whole = torch.load(tmp_path / "whole" / f"stage{stage}.pt")
        resumed = torch.load(tmp_path / "killed" / f"stage{stage}.pt")
        for name, value in whole.items():
            assert torch.equal(resumed[name], value), f"stage {stage}: {name}"

