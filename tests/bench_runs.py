"""Running a benchmark script the way its smoke test does: a fresh interpreter from the repository root, out of
any distributed environment the test process may carry, its JSON read back."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_benchmark(script: str, out, *args: str, timeout: int = 240) -> tuple[str, dict]:
    """``benchmarks/<script> *args --out <out>``; (its stdout, its JSON). Fails with the end of its output."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out) as f:
        return proc.stdout, json.load(f)
