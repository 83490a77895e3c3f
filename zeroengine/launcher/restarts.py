"""``--max_restarts N`` (torchrun's name): a failed job is started again, up to N times.

When a rank fails, the supervisor stops every rank as always (supervisor.py); with restarts left, the job
then starts again from the top, every rank anew, and the script resumes from its last checkpoint
(``engine.load_checkpoint``: the checkpoint loads at any world size, and a restarted job meets on a new
port, ``MASTER_PORT + restart``, so the previous rendezvous cannot linger in the way). Each rank sees the
attempt in ``ZEROENGINE_RESTART_COUNT`` and, as under torchrun, ``TORCHELASTIC_RESTART_COUNT`` (0 first).
A job stopped by the user (Ctrl-C, SIGTERM, a closed launcher link) is never restarted.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, TextIO

from .commands import LaunchCommand
from .supervisor import Supervisor

RESTART_VARIABLES = ("ZEROENGINE_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def with_restart_count(commands: Sequence[LaunchCommand], restart: int) -> List[LaunchCommand]:
    """``commands`` with the attempt number exported to each."""
    count = {name: str(restart) for name in RESTART_VARIABLES}
    return [replace(command, env={**command.env, **count}) for command in commands]


def run_with_restarts(commands_for: Callable[[int], Sequence[LaunchCommand]], max_restarts: int,
                      noun: str = "ranks", grace_period: float = 5.0, watch_stdin: bool = False,
                      log: Optional[TextIO] = None,
                      before_restart: Optional[Callable[[int], Optional[str]]] = None, first_count: int = 0) -> int:
    """Run the job ``commands_for(restart)`` builds, again after a failure while restarts are left; the exit
    code of the last attempt (0 only if it succeeded). ``before_restart(restart)`` runs before each restart (a
    job of several nodes leaves out those that cannot be reached: node_restarts.py); a reason it returns ends
    the job instead. ``first_count``: the attempt the ranks are told first (a node launcher started by a
    job of several nodes passes on the job's attempt, which it receives as ZEROENGINE_RESTART_COUNT)."""
    log = log if log is not None else sys.stderr
    for restart in range(max_restarts + 1):
        supervisor = Supervisor(with_restart_count(commands_for(restart), first_count + restart), noun, grace_period,
                                watch_stdin, log=log)
        code = supervisor.run()
        if code == 0 or supervisor.stopped_by_user:
            return code
        if restart == max_restarts:
            if max_restarts:
                print(f"zeroengine: {supervisor.failed or 'the job'} failed again (exit code {code}) after "
                      f"{max_restarts} restart(s): giving up", file=log, flush=True)
            return code
        print(f"zeroengine: {supervisor.failed or 'the job'} failed (exit code {code}); restarting every "
              f"{noun[:-1] if noun.endswith('s') else noun} of the job: restart {restart + 1} of {max_restarts}",
              file=log, flush=True)
        problem = before_restart(restart + 1) if before_restart is not None else None
        if problem:
            print(f"zeroengine: cannot restart: {problem}", file=log, flush=True)
            return code
    return code  # (not reached)
