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
