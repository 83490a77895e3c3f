"""End-to-end tests of the ``zeroengine`` launcher: real processes, gloo on loopback.

The launcher always runs as ``python -m zeroengine.launcher.main`` in a
subprocess (no PATH needed). Worker scripts live in tests/launcher_scripts/
and import only torch (or nothing), never the engine.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "launcher_scripts"
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
             "CUDA_VISIBLE_DEVICES")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """Our environment without rank variables, with the repo importable."""
    env = {k: v for k, v in os.environ.items()
           if k not in RANK_VARS and not k.startswith(("SLURM_", "OMPI_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    env.update(extra)
    return env


def launcher_argv(*args) -> list:
    return [sys.executable, "-m", "zeroengine.launcher.main", *map(str, args)]


def run_launcher(*args, cwd, timeout=60, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(launcher_argv(*args), cwd=cwd, env=env or clean_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def start_launcher(*args, cwd, env=None) -> subprocess.Popen:
    return subprocess.Popen(launcher_argv(*args), cwd=cwd, env=env or clean_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_files(folder: Path, names, timeout=30.0) -> dict:
    """Wait until every file exists; return {name: int(content)}."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((folder / n).exists() for n in names):
            return {n: int((folder / n).read_text()) for n in names}
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {names} in {folder}: "
                         f"{sorted(p.name for p in folder.iterdir())}")


def assert_stopped_soon_after_failure(folder: Path, limit=10.0) -> None:
    """The launcher exited within ``limit`` s of the worker writing fail.time."""
    elapsed = time.time() - float((folder / "fail.time").read_text())
    assert elapsed < limit, f"launcher exited {elapsed:.1f}s after the failure"


def recorded_pids(folder: Path) -> list:
    return [int(p.read_text()) for p in folder.glob("*.pid")]


def assert_all_gone(pids, timeout=5.0) -> None:
    """No recorded process is alive (zombies count as gone: they have exited)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in alive:  # don't leak them into the rest of the session
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"processes still running: {alive}"


def test_two_ranks_all_reduce(tmp_path):
    result = run_launcher("--num_procs", 2, "--master_port", free_port(),
                          SCRIPTS / "allreduce_worker.py", "--expect_world", 2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rank 0/2 all_reduce ok sum=3" in result.stdout
    assert "rank 1/2 all_reduce ok sum=3" in result.stdout


def test_failing_rank_stops_the_others(tmp_path):
    result = run_launcher("--num_procs", 2, "--master_port", free_port(),
                          SCRIPTS / "fail_worker.py", tmp_path, cwd=tmp_path, timeout=60)
    assert_stopped_soon_after_failure(tmp_path)
    assert result.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose" in result.stderr
    assert "zeroengine: rank 1 (pid" in result.stderr
    assert "exited with code 1; stopping the other ranks" in result.stderr
    pids = recorded_pids(tmp_path)
    assert len(pids) == 3  # two ranks and rank 0's own child
    assert_all_gone(pids)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_all(tmp_path, signum):
    proc = start_launcher("--num_procs", 2, "--grace_period", 2,
                          SCRIPTS / "sleep_worker.py", tmp_path, "--spawn_child", cwd=tmp_path)
    try:
        pids = wait_for_files(tmp_path, ["0.pid", "1.pid", "0.child.pid", "1.child.pid"])
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    assert f"received {signal.Signals(signum).name}; stopping all ranks" in err
    assert_all_gone(pids.values())


def test_rank_variables_and_script_args(tmp_path):
    """Every torchrun variable is set, and script args pass through untouched."""
    port = free_port()
    result = run_launcher("--num_gpus", 2, "--master_port", port, "--module", "env_worker",
                          tmp_path, "--num_procs", "7", "--x=1", "a b", cwd=SCRIPTS,
                          env=clean_env(OMP_NUM_THREADS="3"))
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["RANK"] == rec["LOCAL_RANK"] == str(rank)
        assert rec["WORLD_SIZE"] == rec["LOCAL_WORLD_SIZE"] == "2"
        assert rec["NODE_RANK"] == rec["GROUP_RANK"] == "0"
        assert (rec["MASTER_ADDR"], rec["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert rec["OMP_NUM_THREADS"] == "3"  # the user's setting is kept
        assert rec["argv"] == ["--num_procs", "7", "--x=1", "a b"]
        assert rec["cwd"] == str(SCRIPTS)


def test_two_nodes_by_hand_form_one_world(tmp_path):
    port = free_port()
    common = ("--num_nodes", 2, "--num_procs", 2, "--master_addr", "127.0.0.1",
              "--master_port", port)
    worker = (SCRIPTS / "allreduce_worker.py", "--expect_world", 4)
    nodes = [start_launcher(*common, "--node_rank", i, *worker, cwd=tmp_path)
             for i in (0, 1)]
    try:
        outputs = [node.communicate(timeout=90) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    joined = outputs[0][0] + outputs[1][0]
    for rank in range(4):
        assert f"rank {rank}/4 all_reduce ok sum=10" in joined


# --- ssh / pdsh, with stand-ins that run the remote command on this machine ---

FAKE_SSH = """\
import os, subprocess, sys
args = sys.argv[1:]
while args[0] == "-o":
    args = args[2:]
host, command = args
with open(os.environ["FAKE_REMOTE_LOG"], "a") as f:
    f.write("ssh " + host + "\\n")
os.execvp("bash", ["bash", "-c", command])
"""

FAKE_PDSH = """\
import os, subprocess, sys
args = sys.argv[1:]
hosts = None
while len(args) > 1:
    if args[0] in ("-f", "-w"):
        hosts = args[1] if args[0] == "-w" else hosts
        args = args[2:]
    else:
        args = args[1:]
assert os.environ["PDSH_RCMD_TYPE"] == "ssh"

def expand(command, host):  # pdsh's %h / %% substitution
    out, i = [], 0
    while i < len(command):
        if command[i] == "%" and command[i + 1] in "h%":
            out.append(host if command[i + 1] == "h" else "%")
            i += 2
        else:
            out.append(command[i])
            i += 1
    return "".join(out)

import time
# like pdsh: each host's command in its own session, a failed host reported on stderr as it happens,
# and pdsh goes on waiting for the others
procs = {h: subprocess.Popen(["bash", "-c", expand(args[0], h)], start_new_session=True) for h in hosts.split(",")}
with open(os.environ["FAKE_REMOTE_LOG"], "a") as f:
    f.write("pdsh " + hosts + "\\n")
codes, running = [], dict(procs)
while running:
    for h, p in list(running.items()):
        if p.poll() is not None:
            del running[h]
            codes.append(p.returncode)
            if p.returncode:
                sys.stderr.write(f"pdsh@fake: {h}: ssh exited with exit code {p.returncode}\\n")
                sys.stderr.flush()
    time.sleep(0.05)
sys.exit(max(codes))
"""


@pytest.fixture
def fake_remote(tmp_path):
    """A bin folder with fake ssh/pdsh, and a hostfile of two loopback names."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("ssh", FAKE_SSH), ("pdsh", FAKE_PDSH)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two names for this machine\n127.0.0.1 slots=2\nlocalhost slots=1\n")
    log = tmp_path / "remote.log"
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                    FAKE_REMOTE_LOG=str(log))
    out = tmp_path / "out"
    out.mkdir()
    return hostfile, env, log, out


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_remote_launch_layout(fake_remote, launcher):
    hostfile, env, log, out = fake_remote
    (out.parent / ".zeroengine_env").write_text("ZE_TEST_VALUE=hello world\n")
    result = run_launcher("--hostfile", hostfile, "--launcher", launcher, "--master_port",
                          free_port(), SCRIPTS / "env_worker.py", out, "50%",
                          cwd=out.parent, env=env)
    assert result.returncode == 0, result.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(r["NODE_RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in records] == \
        [("0", "0", "2"), ("0", "1", "2"), ("1", "0", "1")]
    assert {r["WORLD_SIZE"] for r in records} == {"3"}
    assert {r["MASTER_ADDR"] for r in records} == {"127.0.0.1"}
    assert all(r["argv"] == ["50%"] for r in records)
    expected = ["ssh 127.0.0.1", "ssh localhost"] if launcher == "ssh" \
        else ["pdsh 127.0.0.1,localhost"]
    assert sorted(log.read_text().split("\n")[:-1]) == expected


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_remote_node_failure_stops_other_nodes(fake_remote, launcher):
    hostfile, env, log, out = fake_remote
    result = run_launcher("--hostfile", hostfile, "--launcher", launcher, "--grace_period", 2,
                          SCRIPTS / "sleep_worker.py", out, "--fail_rank", 2,
                          cwd=out.parent, env=env)
    assert_stopped_soon_after_failure(out)
    assert result.returncode == 3, result.stderr
    assert "zeroengine: rank 2 (pid" in result.stderr
    if launcher == "ssh":
        assert "zeroengine: node 1 (localhost) (pid" in result.stderr
        assert "stopping the other nodes" in result.stderr
    else:  # pdsh reports the node and waits on; its stop command (pkill by job id) stops node 0
        assert "pdsh reported a failure (pdsh@fake: localhost: ssh exited with exit code 3)" in result.stderr
        assert "stopping pdsh's remote processes" in result.stderr
    pids = recorded_pids(out)
    assert len(pids) == 3
    assert_all_gone(pids)


def test_signal_under_pdsh_reaches_the_remote_ranks(fake_remote):
    """pdsh's remote launchers are in sessions of their own (killing pdsh misses them) and watch no
    stdin: the stop command (pkill by the job id, through a second pdsh) has to reach them."""
    hostfile, env, log, out = fake_remote
    proc = start_launcher("--hostfile", hostfile, "--launcher", "pdsh", "--grace_period", 2,
                          SCRIPTS / "sleep_worker.py", out, cwd=out.parent, env=env)
    try:
        pids = wait_for_files(out, ["0.pid", "1.pid", "2.pid"])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopping pdsh's remote processes" in err
    assert_all_gone(pids.values())


def test_remote_ranks_stop_when_launching_node_dies(tmp_path):
    """--watch_stdin: the node launcher ends its ranks when its ssh stdin closes."""
    proc = subprocess.Popen(
        launcher_argv("--launcher", "local", "--world_layout", "a:0,1@b:0",
                      "--node_rank", 0, "--watch_stdin", SCRIPTS / "sleep_worker.py",
                      tmp_path),
        cwd=tmp_path, env=clean_env(), stdin=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        pids = wait_for_files(tmp_path, ["0.pid", "1.pid"])
        proc.stdin.close()
        proc.wait(timeout=15)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert "stdin closed" in err
    assert_all_gone(pids.values())


def test_launcher_killed_hard_takes_ranks_along(tmp_path):
    """Even SIGKILL of the launcher leaves no rank running (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux only")
    proc = start_launcher("--num_procs", 2, SCRIPTS / "sleep_worker.py", tmp_path,
                          cwd=tmp_path)
    try:
        pids = wait_for_files(tmp_path, ["0.pid", "1.pid"])
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert_all_gone(pids.values())
