"""The zeroengine command line: argument errors (exit 2, one line) and --dry_run plans."""
import shlex
import subprocess
import sys

import pytest

from zeroengine.launcher import main as cli
from zeroengine.launcher.main import main


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return "train.py"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def check_usage_error(capsys, *argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("zeroengine: error: "), err
    assert message in err
    assert "Traceback" not in err


def test_errors(capsys, script, tmp_path):
    bad_hostfile = tmp_path / "hf"
    bad_hostfile.write_text("a slots=1\nb slot=2\n")
    cases = [
        (["missing.py"], "script not found: missing.py"),
        (["--num_gpus", 2, "--num_procs", 3, script], "--num_gpus 2 and --num_procs 3 disagree"),
        (["--num_nodes", 2, "--node_rank", 2, script], "--node_rank 2 must be < --num_nodes 2"),
        (["--node_rank", 1, script], "--node_rank 1 must be < --num_nodes 1"),
        (["--hostfile", tmp_path / "nope", script], "not found"),
        (["--hostfile", bad_hostfile, script], f"{bad_hostfile}, line 2"),
        (["--include", "localhost", "--exclude", "localhost:0", script],
         "--include and --exclude are mutually exclusive"),
        (["--num_procs", 0, script], "--num_procs must be >= 1"),
        (["--master_port", 0, script], "not a valid TCP port"),
        (["--launcher", "ssh", script], "--launcher ssh needs --hostfile"),
        (["--num_procs", 2, "--include", "localhost:5", script], "slot 5 does not exist"),
        (["--num_procs", "two", script], "invalid int value: 'two'"),
        (["--launcher", "mpi", script], "invalid choice: 'mpi'"),
        ([], "the following arguments are required: SCRIPT"),
    ]
    for argv, message in cases:
        check_usage_error(capsys, *argv, message=message)


@pytest.mark.parametrize("devices", [0, 3])
def test_default_is_one_process_per_gpu_or_one(capsys, script, monkeypatch, devices):
    monkeypatch.setattr(cli, "_device_count", lambda: devices)
    code, out, _ = run(capsys, "--dry_run", script)
    assert code == 0
    assert [line.split(":")[0] for line in out.splitlines()] == \
        [f"rank {r}" for r in range(devices or 1)]


def test_same_num_gpus_and_num_procs_is_fine(capsys, script):
    code, out, _ = run(capsys, "--dry_run", "--num_gpus", 2, "--num_procs", 2, script)
    assert code == 0 and out.count("train.py") == 2


def test_dry_run_local(capsys, script):
    code, out, _ = run(capsys, "--dry_run", "--num_procs", 2, "--num_nodes", 2,
                       "--node_rank", 1, "--master_addr", "10.0.0.1", "--master_port",
                       1234, script, "--deepspeed", "--lr", "1")
    assert code == 0
    python = shlex.quote(sys.executable)
    assert out.splitlines() == [
        f"rank {r}: RANK={r} LOCAL_RANK={r - 2} WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 "
        f"GROUP_RANK=1 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=1234 "
        f"OMP_NUM_THREADS=1 {python} -u train.py --deepspeed --lr 1" for r in (2, 3)]


def test_dry_run_include_sets_visible_devices(capsys, script, monkeypatch):
    monkeypatch.setattr(cli, "_device_count", lambda: 4)  # a node with 4 GPUs
    code, out, _ = run(capsys, "--dry_run", "--include", "localhost:1,3", "--no_python",
                       f"./{script}")
    assert code == 0
    assert [line.split(": ", 1)[0] for line in out.splitlines()] == ["rank 0", "rank 1"]
    assert "CUDA_VISIBLE_DEVICES=1,3" in out and "LOCAL_WORLD_SIZE=2" in out
    assert out.splitlines()[0].endswith(" ./train.py")
    code, out, _ = run(capsys, "--dry_run", "--exclude", "localhost:0", "--num_gpus", 2,
                       script)
    assert code == 0 and out.count("CUDA_VISIBLE_DEVICES=1,2 ") == 2
    check_usage_error(capsys, "--include", "localhost:1", "--num_gpus", 2, script,
                      message="--num_procs 2 requested but localhost has only 1 slot")


def test_dry_run_hostfile(capsys, script, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/lib")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=4\nnode-b slots=4\nnode-c slots=4\n")
    code, out, _ = run(capsys, "--dry_run", "-H", hostfile, "--exclude", "node-b",
                       "--num_procs", 2, "--launcher", "ssh", script, "--x")
    assert code == 0
    lines = out.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == ["node 0 (node-a)", "node 1 (node-c)"]
    assert "--world_layout node-a:0,1@node-c:0,1 --node_rank 1 --master_addr node-a" in lines[1]
    assert "export PYTHONPATH=/lib" in lines[1]
    # One selected host and no --launcher: run here, master on loopback.
    code, out, _ = run(capsys, "--dry_run", "-H", hostfile, "--include", "node-c:2",
                       script)
    assert code == 0
    assert out.startswith("rank 0: RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 "
                          "GROUP_RANK=0 NODE_RANK=0 MASTER_ADDR=127.0.0.1 ")
    assert "CUDA_VISIBLE_DEVICES=2" in out
    # --launcher local with several hosts needs to know which node this is.
    check_usage_error(capsys, "-H", hostfile, "--launcher", "local", script,
                      message="pass --node_rank")
    check_usage_error(capsys, "-H", hostfile, "--launcher", "pdsh", "--node_rank", 0,
                      script, message="--node_rank is for --launcher local")


def test_world_layout_node_selection(capsys, script):
    code, out, _ = run(capsys, "--dry_run", "--launcher", "local", "--world_layout",
                       "h1:0@h2:0,1", "--node_host", "h2", "--master_addr", "h1", script)
    assert code == 0
    assert [line.split(" ", 3)[2] for line in out.splitlines()] == ["RANK=1", "RANK=2"]
    check_usage_error(capsys, "--world_layout", "h1:0", "--node_host", "h9", script,
                      message="--node_host 'h9' is not in --world_layout")


def test_help(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--hostfile" in out and "--num_procs" in out


def test_slurm_keeps_an_exported_master_port_and_refuses_what_srun_cannot_do(capsys, script, tmp_path,
                                                                              monkeypatch):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    monkeypatch.setenv("MASTER_PORT", "12345")
    code, out, _ = run(capsys, "--launcher", "slurm", "--num_nodes", 2, "--num_procs", 2, "--dry_run", script)
    assert code == 0 and "MASTER_PORT=12345" in out  # docs/cli.md: an exported MASTER_PORT overrides it
    code, out, _ = run(capsys, "--launcher", "slurm", "--num_nodes", 2, "--num_procs", 2, "--master_port", 777,
                       "--dry_run", script)
    assert code == 0 and "MASTER_PORT=777" in out  # the flag wins
    check_usage_error(capsys, "-H", hostfile, "--launcher", "slurm", "-i", "worker-0:1@worker-1:1", "--dry_run",
                      script, message="--launcher slurm cannot select devices")
    check_usage_error(capsys, "--launcher", "slurm", "--pass_local_rank", "--dry_run", script,
                      message="--pass_local_rank with --launcher slurm")


def test_a_hostfile_selecting_one_remote_host_warns_that_the_ranks_run_here(capsys, script, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    code, _, err = run(capsys, "-H", hostfile, "-i", "worker-1", "--dry_run", script)
    assert code == 0 and "selects one host, worker-1; its ranks run here" in err
    hostfile.write_text("localhost slots=2\n")
    code, _, err = run(capsys, "-H", hostfile, "--dry_run", script)
    assert code == 0 and "warning" not in err


def test_no_python_runs_a_bare_name_from_path_as_a_shell_would(capsys, script):
    # a bare name is looked up on PATH when the ranks start: a file of that name here is not what runs
    check_usage_error(capsys, "--dry_run", "--no_python", script,
                      message="program not found on PATH: train.py (to run the file train.py in this folder, "
                              "write ./train.py)")
    code, out, _ = run(capsys, "--dry_run", "--no_python", "true")
    assert code == 0 and out.rstrip().endswith(" true")


def test_master_address_of_an_ssh_alias_comes_from_the_host(capsys, script, tmp_path, monkeypatch):
    # hostfiles may name hosts by ~/.ssh/config aliases, which do not resolve outside ssh
    hostfile = tmp_path / "hf"
    hostfile.write_text("gpu-box-alias slots=1\nlocalhost slots=1\n")

    def resolve(host, port):
        if host == "gpu-box-alias":
            raise OSError("Name or service not known")
        return [()]

    asked = []

    def ssh(argv, **kwargs):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, answer[0], stdout=answer[1], stderr="")

    monkeypatch.setattr(cli.socket, "getaddrinfo", resolve)
    monkeypatch.setattr(cli.subprocess, "run", ssh)
    answer = (0, "10.1.2.3 fd00::5 \n")
    what, job = cli.plan(cli.build_parser().parse_args(["-H", str(hostfile), script]))
    assert job.master_addr == "10.1.2.3" and asked[0][-2:] == ["gpu-box-alias", "hostname -I"]
    assert all("--master_addr 10.1.2.3" in " ".join(c.argv) for c in what.commands())
    answer = (255, "")  # the host is not reachable either
    check_usage_error(capsys, "-H", hostfile, script,
                      message="the first host, gpu-box-alias, is where the ranks meet (MASTER_ADDR), but its "
                              "name does not resolve here")
    assert job.master_addr == cli.plan(cli.build_parser().parse_args(
        ["-H", str(hostfile), "--master_addr", "10.1.2.3", script]))[1].master_addr  # given: not asked
    assert len(asked) == 2
