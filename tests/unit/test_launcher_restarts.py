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
