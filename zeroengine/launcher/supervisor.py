"""Run a set of processes as one job: all of them succeed, or all of them stop.

Used for the ranks of one node (``local.py``) and for the per-node ssh/pdsh/srun
commands of a multi-node launch (``main.py``). The rules:

* Each child starts in its own session (``start_new_session``), so it and
  everything it spawns (data-loader workers, compilers) form one process group
  that ``killpg`` reaches, and a Ctrl-C in the terminal reaches only us.
* The first child to exit non-zero ends the job: we say which one on stderr,
  send SIGTERM to every child's group, wait up to ``grace_period`` seconds,
  then SIGKILL whatever is left. Our exit code is the child's (128+N when it
  died of signal N), so failures are never reported as success.
* SIGINT/SIGTERM/SIGHUP sent to us are forwarded the same way; we exit with
  128+signum. A second signal skips the grace period.
* On Linux each direct child also gets SIGTERM if we die without cleaning up
  (``PR_SET_PDEATHSIG``), e.g. when we are SIGKILLed.
* A command with a ``failure_marker`` has its stderr read line by line (and
  passed on): a line with the marker and a non-zero code fails the job as if
  the command had exited with it. A command with a ``stop_argv`` has that run
  (bounded by the grace period) when the job stops while it is still running.
  Both are for pdsh (see ``commands.py``).
"""
from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence, TextIO

from .commands import LaunchCommand

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code_of(returncode: int) -> int:
    """A child's ``Popen.returncode`` as a shell-style exit code (signal N → 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent_hook() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when we die."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # we died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return hook


def _killpg(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


class Supervisor:
    """Starts ``commands`` and watches them until the job is over (see module doc)."""

    def __init__(self, commands: Sequence[LaunchCommand], noun: str = "ranks",
                 grace_period: float = 5.0, watch_stdin: bool = False,
                 poll_interval: float = 0.1, log: Optional[TextIO] = None):
        self.commands = list(commands)
        self.noun = noun
        self.grace_period = grace_period
        self.watch_stdin = watch_stdin
        self.poll_interval = poll_interval
        self.log = log if log is not None else sys.stderr
        self.procs: List[subprocess.Popen] = []
        self._signals: List[int] = []
        self._reported: List[tuple] = []  # (command, code) from failure markers, appended by reader threads
        # how the job ended, for a caller that may start it again (restarts.py): the name of the command that
        # failed first, and whether the job was stopped from outside (a signal, a closed launcher link)
        self.failed: Optional[str] = None
        self.stopped_by_user = False

    # --- public ---------------------------------------------------------------

    def run(self) -> int:
        """Start every command and return the job's exit code."""
        previous = self._install_handlers()
        try:
            code = self._start_all()
            if code is None:
                code = self._monitor()
            return code
        finally:
            self._restore_handlers(previous)

    # --- internals --------------------------------------------------------------

    def _say(self, message: str) -> None:
        print(f"zeroengine: {message}", file=self.log, flush=True)

    def _on_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)

    def _install_handlers(self):
        previous = {}
        for signum in FORWARDED_SIGNALS:
            try:
                previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: the caller handles signals
                break
        return previous

    @staticmethod
    def _restore_handlers(previous) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _start_all(self) -> Optional[int]:
        preexec = _die_with_parent_hook()
        for command in self.commands:
            if self._signals:
                break  # asked to stop while starting: _monitor handles it
            if command.hold_stdin:
                stdin = subprocess.PIPE
            else:  # our stdin is the watched link: children must not read it
                stdin = subprocess.DEVNULL if self.watch_stdin else None
            try:
                proc = subprocess.Popen(list(command.argv), env={**os.environ, **command.env},
                                        stdin=stdin, start_new_session=True, preexec_fn=preexec,
                                        stderr=subprocess.PIPE if command.failure_marker else None)
            except OSError as e:
                self._say(f"cannot start {command.name} ({command.argv[0]}): "
                          f"{e.strerror or e}; stopping the other {self.noun}")
                self._stop(signal.SIGTERM)
                return 127 if isinstance(e, FileNotFoundError) else 1
            self.procs.append(proc)
            if command.failure_marker:
                threading.Thread(target=self._read_stderr, args=(command, proc), daemon=True).start()
        return None

    def _read_stderr(self, command: LaunchCommand, proc: subprocess.Popen) -> None:
        """Pass ``proc``'s stderr on, and note a reported failure (see module doc)."""
        pattern = re.compile(re.escape(command.failure_marker) + r"(-?\d+)")
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            sys.stderr.flush()
            found = pattern.search(line)
            if found and int(found.group(1)) != 0:
                self._reported.append((command, int(found.group(1)), line.strip()))

    def _monitor(self) -> int:
        while True:
            if self._signals:
                signum = self._signals[0]
                self._say(f"received {_signal_name(signum)}; stopping all {self.noun}")
                self.stopped_by_user = True
                self._stop(signum)
                return 128 + signum
            if self.watch_stdin and self._stdin_closed():
                self._say(f"stdin closed (the launching node went away); "
                          f"stopping all {self.noun}")
                self.stopped_by_user = True
                self._stop(signal.SIGTERM)
                return 128 + signal.SIGHUP
            if self._reported:
                command, code, line = self._reported[0]
                self._say(f"{command.name} reported a failure ({line}); stopping all {self.noun}")
                self.failed = command.name
                self._stop(signal.SIGTERM)
                return exit_code_of(code)
            for command, proc in zip(self.commands, self.procs):
                code = proc.poll()
                if code is not None and code != 0:
                    self._report_failure(command, proc, code)
                    self.failed = command.name
                    self._stop(signal.SIGTERM)
                    return exit_code_of(code)
            if all(proc.returncode == 0 for proc in self.procs):
                return 0
            time.sleep(self.poll_interval)

    def _report_failure(self, command: LaunchCommand, proc: subprocess.Popen,
                        code: int) -> None:
        how = (f"was killed by {_signal_name(-code)}" if code < 0
               else f"exited with code {code}")
        self._say(f"{command.name} (pid {proc.pid}) {how}; stopping the other {self.noun}")

    def _stdin_closed(self) -> bool:
        try:
            readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0)
            return bool(readable) and os.read(sys.stdin.fileno(), 65536) == b""
        except (OSError, ValueError):
            return False

    def _stop(self, signum: int) -> None:
        """Signal every child's group, wait for the grace period, then SIGKILL.

        Groups of children that already exited are signalled too: their own
        children may still be running.
        """
        seen = len(self._signals)
        self._run_stop_commands()
        for proc in self.procs:
            _killpg(proc.pid, signum)
        deadline = time.monotonic() + self.grace_period
        while time.monotonic() < deadline and len(self._signals) <= seen:
            if all(proc.poll() is not None for proc in self.procs):
                break
            time.sleep(0.05)
        for proc in self.procs:
            _killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def _run_stop_commands(self) -> None:
        for command, proc in zip(self.commands, self.procs):
            if command.stop_argv is None or proc.poll() is not None:
                continue
            self._say(f"stopping {command.name}'s remote processes: {' '.join(command.stop_argv[:-1])} ...")
            try:
                subprocess.run(list(command.stop_argv), env={**os.environ, **command.env},
                               stdin=subprocess.DEVNULL, timeout=max(self.grace_period, 1.0) + 5.0)
            except (OSError, subprocess.TimeoutExpired) as e:
                self._say(f"the stop command for {command.name} failed: {e}")


def supervise(commands: Sequence[LaunchCommand], noun: str = "ranks",
              grace_period: float = 5.0, watch_stdin: bool = False) -> int:
    """Run ``commands`` as one job (see ``Supervisor``) and return its exit code."""
    return Supervisor(commands, noun, grace_period, watch_stdin).run()
