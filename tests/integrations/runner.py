"""Running the integration scripts (tests/integrations/scripts/) the way users run them: ``python``,
``torchrun`` or the ``zeroengine`` launcher, with or without ``ZEROENGINE_AS_DEEPSPEED``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
CONFIGS = os.path.join(HERE, "configs")
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "ZEROENGINE_AS_DEEPSPEED", "ACCELERATE_USE_DEEPSPEED")


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def config(name: str) -> str:
    return os.path.join(CONFIGS, name)


def environment(switch: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([SCRIPTS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    if switch:
        env["ZEROENGINE_AS_DEEPSPEED"] = "1"
    return env


def launch(how: str, procs: int, argv: list[str], port: int | None = None) -> list[str]:
    """The command line: ``python`` (one process), ``torchrun``, ``zeroengine`` (``--as_deepspeed``) or
    ``accelerate`` (``accelerate launch --use_deepspeed``, one machine). ``port``: the zeroengine launcher's
    ``--master_port`` (its default, 29500, serves one job at a time: runs that overlap each take a free one)."""
    if how == "python":
        assert procs == 1
        return [sys.executable, *argv]
    if how == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", *argv]
    if how == "zeroengine":
        return [sys.executable, "-m", "zeroengine.launcher.main", f"--num_procs={procs}", "--as_deepspeed",
                *([f"--master_port={port}"] if port is not None else []), *argv]
    if how == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "2",
                f"--num_processes={procs}", "--num_machines=1", *argv]
    raise ValueError(how)


def run(command: list[str], switch: bool = True, timeout: float = 240, cwd: str | None = None):
    """Run ``command`` to completion; a non-zero exit fails with its output. ``timeout`` is below pytest's own
    (300 s, pyproject.toml), so a hung run fails naming its command; a test making several runs carries a
    ``pytest.mark.timeout`` covering them (tests/unit/test_test_timeouts.py)."""
    proc = subprocess.run(command, env=environment(switch), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(command)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


class Started:
    """A run started in the background (``start``), so that runs which do not depend on each other overlap:
    most of a run is one process importing torch and the trainer's library on one core, and this machine has
    more. ``wait()`` checks it as ``run`` does: a non-zero exit fails with its output, and a run past its
    ``timeout`` (counted from its start) is killed and fails naming its command. Its stdout and stderr go to files,
    not pipes (a pipe nobody reads would fill and block it)."""

    def __init__(self, command: list[str], switch: bool = True, timeout: float = 240, cwd: str | None = None,
                 env: dict | None = None):
        self.command, self.deadline = command, time.monotonic() + timeout
        self._stdout, self._stderr = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
        # Its own process group: stop() ends the processes it started too (Lightning's rank 1, torchrun's workers).
        self._proc = subprocess.Popen(command, env=env if env is not None else environment(switch), cwd=cwd,
                                      stdout=self._stdout, stderr=self._stderr, text=True, start_new_session=True)
        self._done = None

    def wait(self) -> str:
        """Its stdout, once it has exited 0."""
        if self._done is None:
            timed_out = False
            try:
                self._proc.wait(max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                self.stop()
            self._done = []
            for output in (self._stdout, self._stderr):
                output.seek(0)
                self._done.append(output.read())
                output.close()
            if timed_out:
                raise AssertionError(f"{' '.join(self.command)} timed out:\n{''.join(self._done)[-6000:]}")
        assert self._proc.returncode == 0, \
            f"{' '.join(self.command)} exited {self._proc.returncode}:\n{''.join(self._done)[-6000:]}"
        return self._done[0]

    def stop(self) -> None:
        """End it and what it started, if still running (a test that did not wait for it failed or was left out):
        SIGTERM first (torchrun and the zeroengine launcher pass it on to the workers they start in sessions of
        their own), then SIGKILL."""
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            if self._proc.poll() is not None:
                return
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass


def start(command: list[str], switch: bool = True, timeout: float = 240, cwd: str | None = None,
          env: dict | None = None) -> Started:
    """``run``, started in the background: ``.wait()`` for it (see ``Started``)."""
    return Started(command, switch, timeout, cwd, env)


class Runs:
    """Runs that overlap, each started as soon as the runs it reads from have ended. ``jobs``: {name: (the names
    it runs after, job)}; ``job(runs, *args)`` starts its processes with ``runs.start`` and returns what the test
    reads. ``schedule(name)`` schedules a job (and what it runs after, first); ``runs(name)`` schedules it if not yet,
    waits for it, and returns what it returned or raises what it raised (a run it came after that failed fails it
    too). ``close()`` stops what is still running: a module fixture's finalizer (see ``for_module``)."""

    def __init__(self, jobs: dict, *args):
        self._specs, self._args = jobs, args
        self._pool = ThreadPoolExecutor(max_workers=32)  # more than any module's jobs: none waits for a thread
        self._jobs: dict[str, Future] = {}
        self._started: list[Started] = []
        self._lock = threading.Lock()
        self._closed = False

    def schedule(self, name: str) -> None:
        if name in self._jobs:
            return
        after, job = self._specs[name]
        for earlier in after:
            self.schedule(earlier)
        # (scheduled before it: the pool starts jobs in order, so a job only ever waits for one already running)
        waits = [self._jobs[a] for a in after]

        def scheduled():
            for earlier in waits:
                earlier.result()
            return job(self, *self._args)

        self._jobs[name] = self._pool.submit(scheduled)

    def start(self, command: list[str], **kwargs) -> Started:
        with self._lock:
            if self._closed:
                raise RuntimeError("closed")
            started = start(command, **kwargs)
            self._started.append(started)
        return started

    def __call__(self, name: str):
        self.schedule(name)
        return self._jobs[name].result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for started in self._started:
            started.stop()
        self._pool.shutdown(wait=True)


def for_module(request, jobs: dict, needs, *args) -> Runs:
    """The ``Runs`` of a module fixture, with every job that the module's selected tests read already scheduled
    (``needs(item)``: the names a test item reads), so they overlap from the first test on; each test then waits
    for its own. The fixture closes it when the module is done."""
    runs = Runs(jobs, *args)
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            for name in needs(item):
                runs.schedule(name)
    return runs


def read(path) -> dict:
    with open(path) as f:
        return json.load(f)


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
