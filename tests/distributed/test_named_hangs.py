"""A rank that does not arrive at a collective is named, through the launcher, within the comm timeout + 30 s
(tests/launcher_scripts/hang_train.py, 2 ranks at ZeRO stage 2, ZEROENGINE_COMM_TIMEOUT=6, heartbeats every 0.5 s): stuck in its own
code (and its Python stack shows where), or left early. The job ends non-zero and the launcher says which rank
failed. (The reports' wording for every case: tests/unit/test_watchdog.py.)"""
import os
import subprocess
import sys
import time

import pytest

from zeroengine.testing import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "launcher_scripts", "hang_train.py")
COMM_TIMEOUT_S = 6
pytestmark = pytest.mark.timeout(300)


def _launch(case):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", ZEROENGINE_COMM_TIMEOUT=str(COMM_TIMEOUT_S), ZEROENGINE_HEARTBEAT_S="0.5")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "zeroengine.launcher.main", "--num_procs", "2", "--master_port",
                           str(free_port()), SCRIPT, case], env=env, capture_output=True, text=True, timeout=240)
    return done, time.monotonic() - started


def test_a_rank_stuck_in_its_own_code_is_named_with_its_stack():
    done, seconds = _launch("stuck")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    assert "hang report from rank 0" in out and "rank 1: stuck in its own code" in out, out[-4000:]
    assert "rank 1's Python stack (asked for by rank 0's hang report)" in out, out[-4000:]
    assert "in slow_data_loading" in out, out[-4000:]  # where rank 1 is stuck, from its own stack
    assert "rank 0 (pid" in out and "exited with code" in out, out[-4000:]  # the launcher reports the failure
    assert seconds < COMM_TIMEOUT_S + 30 + 15, seconds  # (15 s: two interpreters starting and importing torch)


def test_a_rank_that_left_early_is_named_as_such():
    done, seconds = _launch("early")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    assert "rank 1: finished 3 steps" in out, out[-4000:]
    assert "rank 1: left early: its script ended" in out, out[-4000:]
    assert seconds < COMM_TIMEOUT_S + 30 + 15, seconds
