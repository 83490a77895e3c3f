"""``zeroengine --max_restarts N``: a failed rank stops every rank (as without it), then the whole job starts
again, up to N times; ranks see the attempt in ZEROENGINE_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT and meet
on MASTER_PORT + attempt. Small scripts without torch, through the launcher's main()."""
import json
import sys

import pytest

from zeroengine.launcher.main import main

# Each rank records what it saw; rank 1 fails (exit 3) on the attempts listed in argv[2].
SCRIPT = """
import json, os, sys
attempt = int(os.environ["ZEROENGINE_RESTART_COUNT"])
seen = {k: os.environ[k] for k in ("RANK", "ZEROENGINE_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")}
with open(os.path.join(sys.argv[1], f"attempt{attempt}_rank{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
if seen["RANK"] == "1" and str(attempt) in sys.argv[2].split(","):
    sys.exit(3)
"""


@pytest.fixture
def job(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZEROENGINE_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return tmp_path, str(script)


def _run(capsys, job, failing: str, *flags):
    folder, script = job
    code = main(["--num_procs", "2", "--master_port", "29611", "--no_python", *flags, sys.executable, script,
                 str(folder), failing])
    return code, capsys.readouterr().err


def _seen(folder, attempt, rank):
    with open(folder / f"attempt{attempt}_rank{rank}.json") as f:
        return json.load(f)


def test_a_failed_rank_restarts_the_whole_job(capsys, job):
    code, err = _run(capsys, job, "0", "--max_restarts", "2")
    assert code == 0
    assert "rank 1 failed (exit code 3); restarting every rank of the job: restart 1 of 2" in err
    folder, _ = job
    for rank in (0, 1):
        second = _seen(folder, 1, rank)
        assert second["ZEROENGINE_RESTART_COUNT"] == second["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert second["MASTER_PORT"] == "29612" and _seen(folder, 0, rank)["MASTER_PORT"] == "29611"
    assert not (folder / "attempt2_rank0.json").exists()  # one restart was enough


def test_without_restarts_the_job_stops_with_the_ranks_code(capsys, job):
    code, err = _run(capsys, job, "0")
    assert code == 3 and "restarting" not in err
    assert not (job[0] / "attempt1_rank0.json").exists()


def test_restarts_are_bounded_and_the_last_code_is_the_jobs(capsys, job):
    code, err = _run(capsys, job, "0,1", "--max-restarts", "1")
    assert code == 3
    assert "restart 1 of 1" in err and "failed again (exit code 3) after 1 restart(s): giving up" in err


def test_a_negative_count_is_a_usage_error(capsys, job):
    code, err = _run(capsys, job, "", "--max_restarts", "-1")
    assert code == 2 and "--max_restarts must be >= 0" in err


# -- a job of several nodes: the nodes that cannot be reached are left out (node_restarts.py) ------------------

def _remote_launch():
    from zeroengine.launcher.commands import JobSpec
    from zeroengine.launcher.node_restarts import RemoteLaunch

    job = JobSpec(script="train.py", master_addr="node-a", master_port=29500, cwd="/work", python="python")
    return RemoteLaunch({"node-a": [0, 1], "node-b": [0, 1], "node-c": [0, 1]}, "ssh", job)


def _restarts(down, min_nodes, log):
    from zeroengine.launcher.node_restarts import NodeRestarts

    return NodeRestarts(_remote_launch(), min_nodes, master_given=False, master_of=lambda host: f"addr-of-{host}",
                        probe=lambda host: host not in down, log=log)


def test_a_restart_leaves_out_the_nodes_that_do_not_answer(tmp_path):
    log = (tmp_path / "log").open("w+")
    restarts = _restarts({"node-a"}, 2, log)
    assert restarts.before_restart(1) is None
    commands = restarts.commands_for(1)
    assert [c.name for c in commands] == ["node 0 (node-b)", "node 1 (node-c)"]
    remote = commands[0].argv[-1]
    assert "--world_layout node-b:0,1@node-c:0,1" in remote and "--master_port 29501" in remote
    assert "--master_addr addr-of-node-b" in remote  # the rendezvous moves off the lost first node
    assert "export ZEROENGINE_RESTART_COUNT=1" in remote and "TORCHELASTIC_RESTART_COUNT=1" in remote
    log.seek(0)
    assert "node(s) node-a cannot be reached: left out; restart 1 runs on 2 node(s), 4 rank(s)" in log.read()


def test_every_node_answering_keeps_the_job_whole_and_too_few_gives_up(tmp_path):
    log = (tmp_path / "log").open("w")
    restarts = _restarts(set(), None, log)
    assert restarts.before_restart(1) is None and len(restarts.commands_for(1)) == 3
    assert "--master_addr node-a" in restarts.commands_for(1)[0].argv[-1]
    by_default = _restarts({"node-c"}, None, log)  # no --min_nodes: every node must answer
    assert by_default.before_restart(1) == ("node(s) node-c cannot be reached (ssh node-c true failed); 2 node(s) "
                                            "left, fewer than --min_nodes 3")


def test_min_nodes_is_checked(capsys, job, tmp_path):
    code, err = _run(capsys, job, "", "--min_nodes", "0")
    assert code == 2 and "--min_nodes must be >= 1, got 0" in err
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    folder, script = job
    code = main(["--hostfile", str(hostfile), "--master_addr", "10.0.0.1", "--min_nodes", "3", "--dry_run", script])
    assert code == 2 and "--min_nodes 3 is more than the job's 2 node(s)" in capsys.readouterr().err
