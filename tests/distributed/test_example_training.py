"""End to end: the example GPT trains through the launcher, on one node and on two 'nodes' on loopback."""
import os
import subprocess
import sys

import pytest
import torch

from zeroengine.testing import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = [os.path.join(REPO, "examples", "gpt", "train.py"), "--zeroengine_config",
         os.path.join(REPO, "examples", "gpt", "config.json"), "--n_layer", "2", "--n_embd", "64", "--steps", "20"]
LAUNCHER = [sys.executable, "-m", "zeroengine.launcher.main"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.mark.timeout(360)  # above the launcher run's 300 s, so a hang fails naming the command
def test_example_trains_on_two_processes():
    port = str(free_port())
    out = subprocess.run(LAUNCHER + ["--num_procs", "2", "--master_port", port] + TRAIN,
                         capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "world 2" in text and "done: 20 steps" in text, text[-3000:]
    assert "tokens/s" in text and "memory per rank" in text
    assert "sample:\ndef " in text  # byte-level text from the trained model, from the prompt "def "


@pytest.mark.timeout(660)  # above the two nodes' 300 s waits, one after the other
def test_two_node_launchers_on_loopback_form_one_world_of_four():
    port = str(free_port())
    common = ["--num_nodes", "2", "--num_procs", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    nodes = [subprocess.Popen(LAUNCHER + common + ["--node_rank", str(i)] + TRAIN, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs
    assert "world 4" in outputs[0] and "done: 20 steps" in outputs[0], outputs[0][-3000:]


def test_the_example_reads_the_python_standard_library_as_bytes():
    sys.path.insert(0, os.path.join(REPO, "examples", "gpt"))
    from text_data import PythonSourceBytes

    data = PythonSourceBytes(block_size=32, max_bytes=100_000)
    x, y = data[3]
    assert len(data) == (100_000 - 1) // 32 and x.shape == y.shape == (32,)
    assert torch.equal(x[1:], y[:-1]) and int(x.max()) < 256  # targets are the inputs shifted by one byte
    assert b"import" in bytes(torch.cat([data[i][0] for i in range(50)]).tolist())  # it is Python source
