"""Supervisor exit-code and shutdown rules, with tiny `python -c` children."""
import io
import sys
import time

from zeroengine.launcher.commands import LaunchCommand
from zeroengine.launcher.supervisor import Supervisor, exit_code_of


def py(name, code):
    return LaunchCommand(name=name, argv=(sys.executable, "-c", code))


SLEEP = "import time; time.sleep(60)"
IGNORE_TERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "print('ready', flush=True); time.sleep(60)")


def supervise(commands, grace=5.0):
    log = io.StringIO()
    start = time.monotonic()
    code = Supervisor(commands, grace_period=grace, poll_interval=0.02, log=log).run()
    return code, log.getvalue(), time.monotonic() - start


def test_all_succeed():
    code, log, _ = supervise([py("rank 0", "pass"), py("rank 1", "import time; time.sleep(0.2)")])
    assert (code, log) == (0, "")


def test_first_failure_wins_and_stops_the_rest():
    sup = Supervisor([py("rank 0", SLEEP), py("rank 1", "import sys; sys.exit(5)")],
                     poll_interval=0.02, log=io.StringIO())
    code = sup.run()
    assert code == 5
    assert f"rank 1 (pid {sup.procs[1].pid}) exited with code 5; stopping the other ranks" \
        in sup.log.getvalue()
    assert sup.procs[0].returncode == -15  # SIGTERM reached the sleeper


def test_killed_by_signal():
    code, log, _ = supervise([py("rank 0", "import os; os.kill(os.getpid(), 9)")])
    assert code == 137 and "was killed by SIGKILL" in log
    assert exit_code_of(-15) == 143 and exit_code_of(3) == 3


def test_sigkill_after_grace_period():
    code, _, elapsed = supervise([py("rank 0", IGNORE_TERM),
                                  py("rank 1", "import time, sys; time.sleep(0.5); sys.exit(2)")],
                                 grace=0.5)
    assert code == 2
    assert elapsed < 4


def test_missing_program():
    code, log, _ = supervise([py("rank 0", SLEEP),
                              LaunchCommand(name="rank 1", argv=("/nonexistent/prog",))])
    assert code == 127 and "cannot start rank 1" in log


REPORTS_FAILURE = ("import sys, time; sys.stderr.write('pdsh@main: worker-1: ssh exited with exit code 9\\n'); "
                   "sys.stderr.flush(); time.sleep(60)")


def test_a_failure_reported_on_stderr_ends_the_job_and_runs_the_stop_command(tmp_path):
    # pdsh reports a failed node and keeps waiting for the others; its remote launchers are reached
    # only by the stop command
    stopped = tmp_path / "stopped"
    remote = LaunchCommand(name="pdsh", argv=(sys.executable, "-c", REPORTS_FAILURE),
                           failure_marker=" exited with exit code ",
                           stop_argv=(sys.executable, "-c", f"open({str(stopped)!r}, 'w').write('x')"))
    code, log, elapsed = supervise([remote], grace=1.0)
    assert code == 9 and elapsed < 10
    assert "pdsh reported a failure (pdsh@main: worker-1: ssh exited with exit code 9)" in log
    assert stopped.read_text() == "x"


def test_a_zero_code_on_stderr_is_not_a_failure_and_no_stop_command_runs_after_success(tmp_path):
    stopped = tmp_path / "stopped"
    remote = LaunchCommand(name="pdsh", argv=(sys.executable, "-c", "import sys; sys.stderr.write("
                                              "'w: ssh exited with exit code 0\\n')"),
                           failure_marker=" exited with exit code ",
                           stop_argv=(sys.executable, "-c", f"open({str(stopped)!r}, 'w')"))
    code, log, _ = supervise([remote])
    assert (code, log) == (0, "") and not stopped.exists()
