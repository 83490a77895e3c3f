"""``zeroengine --hostfile H --max_restarts 1 --min_nodes 1``: a node that cannot be reached after a failure is left
out and the job resumes at the smaller world (4 ranks on 2 nodes, then 2 on 1), continuing the epoch with no sample
repeated or skipped (tests/launcher_scripts/shrink_train.py). The nodes are this machine under two names, reached
through a stand-in ssh that runs the remote command here, and fails for the hosts listed in a "down" file."""
import os
import subprocess
import sys

import pytest

from zeroengine.testing import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "launcher_scripts", "shrink_train.py")
pytestmark = pytest.mark.timeout(300)

FAKE_SSH = """\
import os, sys
args = sys.argv[1:]
while args[0] == "-o":
    args = args[2:]
host, command = args
down = os.environ["FAKE_DOWN_FILE"]
if os.path.exists(down) and host in open(down).read().split():
    sys.stderr.write(f"ssh: connect to host {host} port 22: No route to host\\n")
    sys.exit(255)
os.execvp("bash", ["bash", "-c", command])
"""


# Gives up before any training: rank 2 (on the second node) marks its node down and fails at once.
LOSE_A_NODE = """\
import os, sys
if os.environ["RANK"] == "2":
    open(sys.argv[2], "w").write("localhost\\n")
    sys.exit(1)
"""


def _launch(tmp_path, min_nodes, script=SCRIPT):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!{sys.executable}\n{FAKE_SSH}")
    ssh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\nlocalhost slots=2\n")
    out = tmp_path / "out"
    out.mkdir()
    down = tmp_path / "down"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_DOWN_FILE=str(down), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "zeroengine.launcher.main", "--hostfile", str(hostfile),
                           "--launcher", "ssh", "--master_port", str(free_port()), "--max_restarts", "1",
                           "--min_nodes", str(min_nodes), "--grace_period", "2", str(script), str(out), str(down)],
                          env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    return done, out


def _samples(out, attempt, rank):
    path = out / f"samples_{attempt}_{rank}.txt"
    return [int(i) for line in path.read_text().split("\n") if line for i in line.split()] if path.exists() else []


def test_a_lost_node_is_left_out_and_the_epoch_goes_on_at_the_smaller_world(tmp_path):
    done, out = _launch(tmp_path, min_nodes=1)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "node 1 (localhost)" in done.stderr and "restart 1 of 1" in done.stderr
    assert "node(s) localhost cannot be reached: left out; restart 1 runs on 1 node(s), 2 rank(s)" in done.stderr
    assert "rank 0 of 2: the epoch is done" in done.stdout and "rank 1 of 2: the epoch is done" in done.stdout
    first = [i for rank in range(4) for i in _samples(out, 0, rank)]
    second = [i for rank in range(2) for i in _samples(out, 1, rank)]
    assert len(first) == 8 and len(second) == 16  # step 1 at 4 ranks, then 4 steps at 2
    assert sorted(first + second) == list(range(24))  # every sample once: none repeated, none skipped


def test_without_enough_nodes_left_the_job_gives_up_naming_them(tmp_path):
    script = tmp_path / "lose_a_node.py"
    script.write_text(LOSE_A_NODE)
    done, _ = _launch(tmp_path, min_nodes=2, script=script)
    assert done.returncode != 0
    assert ("cannot restart: node(s) localhost cannot be reached (ssh localhost true failed); 1 node(s) left, "
            "fewer than --min_nodes 2") in done.stderr
