"""Smoke test of benchmarks/bench_stages.py: --quick runs every (non-DeepSpeed) variant and writes sane JSON.

Nothing here asserts a timing or a memory target: the benchmark reports those,
side by side; the test only checks that it runs and that every number is there.
"""
import math

import pytest
from bench_runs import run_benchmark

VARIANTS = {"ddp", "fsdp2", "ze-s0", "ze-s1", "ze-s2", "ze-s3", "ze-s3+init"}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.slow
def test_quick_run_reports_every_variant_with_finite_numbers(tmp_path):
    stdout, result = run_benchmark("bench_stages.py", tmp_path / "stages.json", "--quick", "--no-deepspeed")
    assert "xDDP" in stdout and "peak RSS" in stdout

    rows = {row["variant"]["name"]: row for row in result["variants"]}
    assert set(rows) == VARIANTS
    psi = result["num_params"]
    assert psi > 0
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["num_params"] == psi
        for key in ("median_step_s", "ratio_to_ddp", "formula_bytes", "rss_growth_over_formula",
                    "rss_growth_cold_over_formula", "final_loss"):
            assert _finite(row[key]), (name, key, row[key])
        assert row["median_step_s"] > 0
        assert all(_finite(p) and p > 0 for p in row["peak_rss_bytes"]), (name, row["peak_rss_bytes"])
        assert all(_finite(g) for g in row["rss_growth_bytes"]), (name, row["rss_growth_bytes"])
        assert _finite(row["comm"]["wire_bytes_per_step"]) and row["comm"]["wire_bytes_per_step"] > 0, name
        assert _finite(row["comm"]["payload_bytes_per_step"]), name
    assert rows["ddp"]["ratio_to_ddp"] == 1.0
    for name in ("ze-s0", "ze-s1", "ze-s2", "ze-s3", "ze-s3+init"):
        # memory_breakdown() is there, and (up to alignment padding, and stage 3's few persistent
        # LayerNorm/bias vectors) docs/concepts.md's formula
        assert abs(rows[name]["model_states_over_formula"] - 1.0) < 0.1, (name, rows[name]["model_states_over_formula"])
    # stage 3 prefetched its gathers, and zeroengine rows carry their step ratio to FSDP2
    fetch = rows["ze-s3"]["comm"]["stage3_fetch"]
    assert fetch["prefetched"] > 0 and fetch["trace_state"] == "replaying", fetch
    assert _finite(rows["ze-s3"]["ratio_to_fsdp2"])
    # same model, seed and batches: every variant ends at the same loss
    losses = [row["final_loss"] for row in rows.values()]
    assert max(losses) - min(losses) < 1e-3, losses
