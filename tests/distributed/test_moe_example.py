"""End to end: the MoE GPT example trains through the launcher under ZeRO stage 2 with ep_size 2 on
2 ranks, and its loss falls (train.py exits non-zero when it does not)."""
import os
import re
import subprocess
import sys

import pytest

from zeroengine.testing import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(360)  # above the launcher run's 300 s, so a hang fails naming the command
def test_moe_example_trains_with_expert_parallelism_through_the_launcher():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "zeroengine.launcher.main", "--num_procs", "2", "--master_port", str(free_port()),
           os.path.join(REPO, "examples", "gpt", "train.py"),
           "--zeroengine_config", os.path.join(REPO, "examples", "gpt", "config_moe.json"),
           "--moe", "--num_experts", "4", "--ep_size", "2", "--n_layer", "2", "--n_embd", "64", "--steps", "20"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "MoE GPT (4 experts, top-2, ep_size 2)" in text and "world 2 | stage 2" in text, text[-3000:]
    assert "done: 20 steps" in text and "loss did not fall" not in text
    first, last = (float(v) for v in re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < first - 0.3, (first, last)  # from ~ln(256) down by a clear margin
