"""Running the integration scripts (tests/integrations/scripts/) the way users run them: ``python``,
``torchrun`` or the ``zeroengine`` launcher, with or without ``ZEROENGINE_AS_DEEPSPEED``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

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


def launch(how: str, procs: int, argv: list[str]) -> list[str]:
    """The command line: ``python`` (one process), ``torchrun``, ``zeroengine`` (``--as_deepspeed``) or
    ``accelerate`` (``accelerate launch --use_deepspeed``, one machine)."""
    if how == "python":
        assert procs == 1
        return [sys.executable, *argv]
    if how == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", *argv]
    if how == "zeroengine":
        return [sys.executable, "-m", "zeroengine.launcher.main", f"--num_procs={procs}", "--as_deepspeed", *argv]
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


def read(path) -> dict:
    with open(path) as f:
        return json.load(f)


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
