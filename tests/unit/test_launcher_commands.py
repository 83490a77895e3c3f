"""Exact ssh / pdsh / srun command lines for a sample hostfile, and env exports."""
from dataclasses import replace

import pytest

from zeroengine.launcher.commands import (
    JobSpec,
    collect_exports,
    find_env_files,
    parse_env_file,
    pdsh_command,
    slurm_command,
    slurm_command_for_layout,
    ssh_commands,
    user_argv,
)
from zeroengine.launcher.hostfile import parse_hostfile_text, world_layout
from zeroengine.launcher.local import plan_from_layout, plan_uniform, rank_env_vars, visible_devices

HOSTFILE = "worker-0 slots=2\nworker-1 slots=2\n"
LAYOUT = world_layout(parse_hostfile_text(HOSTFILE))
JOB = JobSpec(script="train.py", script_args=("--deepspeed_config", "ds config.json"),
              master_addr="worker-0", master_port=29500, cwd="/home/me/proj",
              python="/opt/py/bin/python", exports={"PYTHONPATH": "/home/me/lib",
                                                   "NCCL_DEBUG": "INFO"})
NODE_CMD = ("/opt/py/bin/python -u -m zeroengine.launcher.main --launcher local "
            "--world_layout worker-0:0,1@worker-1:0,1 {node} --master_addr worker-0 "
            "--master_port 29500{extra} train.py --deepspeed_config 'ds config.json'")
PREFIX = "cd /home/me/proj && export PYTHONPATH=/home/me/lib && export NCCL_DEBUG=INFO && "


def test_ssh_commands():
    commands = ssh_commands(LAYOUT, JOB)
    assert [c.name for c in commands] == ["node 0 (worker-0)", "node 1 (worker-1)"]
    for i, command in enumerate(commands):
        assert command.argv == (
            "ssh", "-o", "BatchMode=yes", f"worker-{i}",
            PREFIX + NODE_CMD.format(node=f"--node_rank {i}", extra=" --watch_stdin"))
        assert command.hold_stdin and not command.env


def test_pdsh_command():
    command = pdsh_command(LAYOUT, replace(JOB, job_id="j42"))
    assert command.argv == (
        "pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1",
        PREFIX + NODE_CMD.format(node="--node_host %h", extra=" --job_id j42"))
    assert command.env == {"PDSH_RCMD_TYPE": "ssh"}
    # pdsh's remote launchers have no stdin to watch: a second pdsh stops them by the job id
    assert command.stop_argv == ("pdsh", "-f", "1024", "-w", "worker-0,worker-1",
                                 "pkill -TERM -f -- '[-]-job_id j42( |$)'")
    assert command.failure_marker == " exited with exit code "
    first, second = pdsh_command(LAYOUT, JOB), pdsh_command(LAYOUT, JOB)
    assert first.stop_argv != second.stop_argv  # a fresh id per job


def test_pdsh_stop_pattern_matches_the_node_launcher_and_not_the_shell_running_it():
    import re
    pattern = "[-]-job_id j42( |$)"
    node = NODE_CMD.format(node="--node_host worker-1", extra=" --job_id j42")
    assert re.search(pattern, node) and re.search(pattern, "python -m zeroengine.launcher.main --job_id j42")
    assert not re.search(pattern, "bash -c pkill -TERM -f -- '[-]-job_id j42( |$)'")
    assert not re.search(pattern, "python launcher --job_id j421")  # another job's id


def test_pdsh_escapes_percent_and_passes_flags():
    job = JobSpec(script="pkg.train", script_args=("--lr=50%",), module=True,
                  master_addr="worker-0", cwd="/w", python="py", grace_period=2.5,
                  pass_local_rank=True, job_id="j7")
    assert pdsh_command(LAYOUT, job).argv[-1] == (
        "cd /w && py -u -m zeroengine.launcher.main --launcher local --world_layout "
        "worker-0:0,1@worker-1:0,1 --node_host %h --master_addr worker-0 --master_port "
        "29500 --grace_period 2.5 --job_id j7 --module --pass_local_rank pkg.train --lr=50%%")


def test_slurm_commands():
    command = slurm_command_for_layout(LAYOUT, JOB)
    assert command.argv == (
        "srun", "--nodes", "2", "--ntasks-per-node", "2", "--kill-on-bad-exit=1",
        "--nodelist", "worker-0,worker-1", "/opt/py/bin/python", "-u", "train.py",
        "--deepspeed_config", "ds config.json")
    assert command.env == {"PYTHONPATH": "/home/me/lib", "NCCL_DEBUG": "INFO",
                           "MASTER_ADDR": "worker-0", "MASTER_PORT": "29500"}
    bare = slurm_command(JobSpec(script="t.py", python="py"), num_nodes=4, procs_per_node=8)
    assert bare.argv == ("srun", "--nodes", "4", "--ntasks-per-node", "8",
                         "--kill-on-bad-exit=1", "py", "-u", "t.py")
    assert bare.env == {"MASTER_PORT": "29500"}  # ranks take the first SLURM node
    uneven = world_layout(parse_hostfile_text("a slots=2\nb slots=1\n"))
    with pytest.raises(ValueError, match="same number of processes.*a=2, b=1"):
        slurm_command_for_layout(uneven, JOB)


def test_user_argv():
    assert user_argv(JobSpec(script="t.py", script_args=("x",), python="py")) == \
        ["py", "-u", "t.py", "x"]
    assert user_argv(JobSpec(script="m", module=True, python="py", pass_local_rank=True),
                     local_rank=3) == ["py", "-u", "-m", "m", "--local_rank=3"]
    assert user_argv(JobSpec(script="./run.sh", no_python=True, script_args=("x",))) == \
        ["./run.sh", "x"]


def test_exports(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "proj"
    home.mkdir(), cwd.mkdir()
    (home / ".zeroengine_env").write_text("A=home\nB=home\n")
    (cwd / ".zeroengine_env").write_text("# comment\n\nexport B=proj value\nC=x=y\n")
    files = find_env_files(str(cwd), str(home))
    environ = {"PYTHONPATH": "/p", "NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "eth0",
               "HOME": "/root", "A": "env"}
    assert collect_exports(environ, files) == {
        "PYTHONPATH": "/p", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1",
        "A": "home", "B": "proj value", "C": "x=y"}
    with pytest.raises(ValueError, match="f, line 2: expected KEY=VALUE"):
        parse_env_file("A=1\nnot a pair\n", "f")


def test_env_file_values_are_read_as_a_shell_reads_them():
    # a .deepspeed_env moved over as it is: DeepSpeed's exports go through the remote shell
    text = ("NCCL_SOCKET_IFNAME=\"eth0\"\nFOO='a b'\nBAZ=x # note\nQ=\"it's # here\"  # note\n"
            "PLAIN=a b\nHASH=a#b\n")
    assert parse_env_file(text) == {"NCCL_SOCKET_IFNAME": "eth0", "FOO": "a b", "BAZ": "x",
                                    "Q": "it's # here", "PLAIN": "a b", "HASH": "a#b"}
    with pytest.raises(ValueError, match="f, line 1: .*quotation"):
        parse_env_file("A='open\n", "f")


def test_env_file_variable_references_expand_on_the_node_as_in_a_shell(monkeypatch):
    # PATH=/usr/local/cuda/bin:$PATH is the commonest .deepspeed_env line; it reached the nodes literally
    import subprocess

    text = ("LD_LIBRARY_PATH=/opt/lib:$LD_LIBRARY_PATH\nDATA=\"${HOME}/data\"\nLIT='$HOME'\n"
            "ODD=\"a\\\"b $NOPE` $(x)\"\nCUDA_HOME=/opt/cuda\nCUDA_BIN=$CUDA_HOME/bin\n"
            "COST=\"cost \\$HOME\"\n")
    job = replace(JOB, exports=parse_env_file(text))
    remote = ssh_commands(LAYOUT, job)[0].argv[-1]
    node_env = {"HOME": "/n", "LD_LIBRARY_PATH": "/n/lib", "PATH": "/usr/bin:/bin"}
    exports = remote.split(" && ", 1)[1].rsplit(" && ", 1)[0]  # without the cd and the launch
    names = ("LD_LIBRARY_PATH", "DATA", "LIT", "ODD", "CUDA_BIN", "COST")
    shown = subprocess.run(["sh", "-c", exports + " && printf '%s|' " + " ".join(f'"${n}"' for n in names)],
                           capture_output=True, text=True, env=node_env, check=True).stdout
    # a value may name a variable set earlier in the file (one export per line, as when sourcing it)
    want = ["/opt/lib:/n/lib", "/n/data", "$HOME", 'a"b ` $(x)', "/opt/cuda/bin", "cost $HOME"]
    assert shown.split("|")[:6] == want
    # srun passes its own environment: there the launching node expands them, the same way
    monkeypatch.setenv("HOME", "/h")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/h/lib")
    monkeypatch.delenv("NOPE", raising=False)
    env = slurm_command_for_layout(LAYOUT, job).env
    assert [env[k] for k in names] == ["/opt/lib:/h/lib", "/h/data", *want[2:]]


def test_node_plans_and_rank_env():
    plan = plan_from_layout({"a": [0, 1, 2], "b": [1, 3]}, node_rank=1,
                            master_addr="a", master_port=7)
    assert (plan.first_rank, plan.world_size, plan.slots) == (3, 5, (1, 3))
    env = rank_env_vars(plan, 1, {})
    assert env == {"RANK": "4", "LOCAL_RANK": "1", "WORLD_SIZE": "5",
                   "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "NODE_RANK": "1",
                   "MASTER_ADDR": "a", "MASTER_PORT": "7", "CUDA_VISIBLE_DEVICES": "1,3",
                   "OMP_NUM_THREADS": "1"}
    plan = plan_uniform(num_nodes=2, node_rank=1, num_procs=2, master_addr="m",
                        master_port=1)
    assert (plan.first_rank, plan.world_size, plan.slots) == (2, 4, (0, 1))
    assert "CUDA_VISIBLE_DEVICES" not in rank_env_vars(plan, 0, {})
    assert rank_env_vars(plan, 0, {"OMP_NUM_THREADS": "4"}).get("OMP_NUM_THREADS") is None
    with pytest.raises(ValueError, match="out of range"):
        plan_from_layout({"a": [0]}, node_rank=1, master_addr="a", master_port=1)


def test_visible_devices():
    assert visible_devices([0, 1], {}) is None
    assert visible_devices([1, 3], {}) == "1,3"
    assert visible_devices([1, 3], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "5,7"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        visible_devices([2], {"CUDA_VISIBLE_DEVICES": "4,5"})


def test_script_args_starting_with_a_double_dash_reach_the_script_through_a_node_launcher():
    from zeroengine.launcher.commands import node_launcher_argv
    from zeroengine.launcher.main import build_parser
    parser = build_parser()
    for script_args in (("--", "x"), ("y",), ("a", "--", "b")):
        job = JobSpec(script="train.py", script_args=script_args, master_addr="a")
        argv = node_launcher_argv(job, {"a": [0]}, ["--node_rank", "0"], watch_stdin=False)
        assert argv[1:4] == ["-u", "-m", "zeroengine.launcher.main"]
        assert tuple(parser.parse_args(argv[4:]).script_args) == script_args  # what the node launcher passes on
