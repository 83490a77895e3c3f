"""Smoke test of benchmarks/bench_activation_checkpointing.py: --quick runs every variant and writes sane JSON.

Timings are reported by the benchmark, never asserted; memory is deterministic, so its direction is checked.
"""
import importlib.util
import json
import math
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "bench_activation_checkpointing.py")


def test_quick_run_reports_every_variant(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_activation_checkpointing", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "ac.json"
    assert bench.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    assert "checkpoint+cpu" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["machine"]["device"] == "cpu"
    assert [(r["L"], r["T"]) for r in result["results"]] == [(2, 32), (4, 32)]
    for res in result["results"]:
        rows = {row["variant"]: row for row in res["variants"]}
        assert set(rows) == set(bench.VARIANTS)
        for row in rows.values():
            for key in ("peak_activation_bytes", "median_step_s", "step_time_ratio", "memory_ratio"):
                assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert rows["none"]["step_time_ratio"] == 1.0
        assert rows["checkpoint"]["peak_activation_bytes"] < rows["none"]["peak_activation_bytes"]
        assert math.isfinite(rows["checkpoint"]["over_prediction"])
    from zeroengine import checkpointing

    assert not checkpointing.is_configured()  # the benchmark leaves the process-wide settings as it found them
