"""The GPU session's long_context phase (benchmarks/bench_long_context_gpu.py) without a GPU.

``DRY_RUN=1 bash benchmarks/gpu_session.sh long_context`` runs the benchmark's search on a tiny Llama on the CPU,
where running out of memory is simulated by a live-bytes budget: the doubling, the bisection, the recovery after
a failure in the middle of a step and the JSON are the ones the GPU call will run. The search policy
(``LengthSearch``), the time prediction and ``--layers auto``'s sizing are also checked alone, with made-up outcomes.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_runs import REPO

sys.path.insert(0, str(Path(REPO) / "benchmarks"))
import bench_long_context_gpu as bench  # noqa: E402

pytest.importorskip("transformers")
BUDGET = 4 * 2**20  # the dry run's --cpu-budget-mib 4 (benchmarks/gpu_session.sh)
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # a test runner's world


def test_dry_run_of_the_session_phase(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(DRY_RUN="1", OUT=str(tmp_path), PYTHON=sys.executable)
    started = time.monotonic()
    proc = subprocess.run(["bash", "benchmarks/gpu_session.sh", "long_context"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "longest trained" in proc.stdout
    report = json.loads((tmp_path / "long_context_gpu.json").read_text())
    assert (tmp_path / "long_context_gpu.log").exists() and not (tmp_path / "gpu.txt").exists()  # no nvidia-smi
    assert report["partial"] is False and report["device"] == "cpu (dry run)" and report["params"] > 0
    assert report["cpu_budget_bytes"] == BUDGET and report["model"]["layers"] == 2

    trials, summary = report["trials"], report["summary"]
    ok = [t for t in trials if t["outcome"] == "ok"]
    oom = [t for t in trials if t["outcome"] == "oom"]
    assert ok and oom and len(ok) + len(oom) == len(trials), trials
    longest, failed = summary["longest_trained"], summary["first_failed"]
    assert longest == max(t["seq"] for t in ok) and failed == min(t["seq"] for t in oom)
    assert failed > longest
    assert all(t["seq"] > longest for t in oom)
    assert all(t["seq"] % 256 == 0 for t in trials)
    stopped = summary["stopped"]["reason"]
    assert stopped == "narrowed" and failed - longest <= 256 or stopped == "time_limit", summary
    for t in ok:
        assert 0 < t["peak_device_bytes"] <= BUDGET and t["step_s"] > 0 and t["tokens_per_s"] > 0
        assert t["host_rss_bytes"] > 0
    for t in oom:  # a simulated failure, raised inside the step once the budget was crossed
        assert t["memory"] == "simulated" and t["peak_device_bytes"] > BUDGET and "simulated" in t["message"]
    # doubling first: the lengths up to the first failure are 256, 512, 1024, ...
    first_oom = next(i for i, t in enumerate(trials) if t["outcome"] == "oom")
    assert [t["seq"] for t in trials[:first_oom + 1]] == [256 * 2**i for i in range(first_oom + 1)]
    # ~15 s on 2 idle cores; far more means the search ran on to its 60 s limit (or the machine is busy)
    assert took < 90, f"the dry run took {took:.0f} s"


def _run(search: bench.LengthSearch, fits) -> list[int]:
    """Feed ``search`` the outcomes of ``fits(seq)``; the lengths it tried, in order."""
    tried = []
    while (seq := search.next()) is not None:
        assert seq not in tried and seq % 256 == 0
        tried.append(seq)
        search.record(seq, fits(seq))
    return tried


def test_search_doubles_then_bisects_to_the_granularity():
    search = bench.LengthSearch(start=16384, granularity=8192, max_seq=1 << 22)
    tried = _run(search, lambda seq: seq <= 300_000)
    assert tried[:6] == [16384, 32768, 65536, 131072, 262144, 524288]
    assert tried[6:] == [393216, 327680, 294912, 311296, 303104]  # halving the gap each time
    assert search.longest_ok == 294912 and search.first_failed == 303104
    assert search.first_failed - search.longest_ok <= 8192 and search.reason == "narrowed"


@pytest.mark.parametrize("limit", [256, 700, 5000, 123_456, 1_000_000])
def test_search_brackets_any_limit(limit):
    search = bench.LengthSearch(start=1024, granularity=256, max_seq=1 << 22)
    _run(search, lambda seq: seq <= limit)
    assert search.longest_ok == limit // 256 * 256
    assert search.first_failed == search.longest_ok + 256


def test_search_when_even_the_start_fails():
    search = bench.LengthSearch(start=4096, granularity=1024, max_seq=1 << 20)
    assert _run(search, lambda seq: seq <= 1500) == [4096, 2048, 1024]
    assert (search.longest_ok, search.first_failed, search.reason) == (1024, 2048, "narrowed")
    nothing = bench.LengthSearch(start=4096, granularity=1024, max_seq=1 << 20)
    assert _run(nothing, lambda seq: False) == [4096, 2048, 1024]
    assert nothing.longest_ok is None and nothing.reason == "nothing_fits"


def test_search_stops_at_the_longest_length_allowed():
    search = bench.LengthSearch(start=1024, granularity=256, max_seq=5000)
    assert _run(search, lambda seq: True) == [1024, 2048, 4096, 4864]
    assert search.reason == "max_seq" and search.first_failed is None


def test_search_refuses_unaligned_settings():
    for start, granularity in ((1000, 256), (1024, 100), (0, 256)):
        with pytest.raises(ValueError):
            bench.LengthSearch(start, granularity, 1 << 20)


def test_predicted_time_grows_with_the_square_of_the_length():
    trials = [{"seq": 1024, "outcome": "ok", "forward_backward_s": 2.0, "optimizer_s": 1.0},
              {"seq": 4096, "outcome": "oom"}]
    assert bench.predict_seconds([], 1024) is None
    assert bench.predict_seconds(trials, 2048) == pytest.approx(1.0 + 2.0 * 4)
    assert bench.predict_seconds(trials, 512) == pytest.approx(3.0)  # shorter: no faster than the last


def test_layers_auto_on_a_128_gib_host():
    p = bench.PRESETS["llama3-8b"]
    assert bench.params_of(p, 32) == 8_030_261_248  # Llama-3-8B
    assert bench.auto_layers(p, 128 * 2**30, offload_param=False) == 18
    assert bench.auto_layers(p, 128 * 2**30, offload_param=True) == 15
    assert bench.auto_layers(p, 2 * 2**40, offload_param=False) == 32  # a host with room for all of them
    assert bench.auto_layers(p, 2**30, offload_param=False) == 1
