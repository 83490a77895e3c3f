"""Smoke test of benchmarks/bench_moe.py: --quick runs every candidate (DeepSpeed skipped) and the
2-rank all-to-all, and writes JSON with finite numbers. No timing is asserted."""
import math

from bench_runs import run_benchmark


def test_quick_run_reports_every_candidate(tmp_path):
    _, result = run_benchmark("bench_moe.py", tmp_path / "moe.json", "--quick", "--no-deepspeed")
    assert [(s["experts"], s["k"]) for s in result["mlp"]] == [(4, 1), (4, 2), (8, 1), (8, 2)]
    for shape in result["mlp"]:
        assert set(shape["rows"]) == {"floor", "traffic", "bound", "naive", "sort", "ze-loop", "zeroengine",
                                      "ze-stacked", "autoep", "autoep-bound"}
        rows = shape["rows"]
        assert rows["bound"]["runs"] == [f + t for f, t in zip(rows["floor"]["runs"], rows["traffic"]["runs"])]
    for shape in result["mlp"] + result["cheap"]:
        assert all(math.isfinite(r["median_s"]) and r["median_s"] > 0 for r in shape["rows"].values())
    assert len(result["mlp_ratios"]) == 4 and "naive/zeroengine" in result["cheap_ratios"][0]
    for shape, r in zip(result["cheap"], result["cheap_ratios"]):  # the overhead rows' shared floor
        rows = shape["rows"]
        assert "gate+experts" in rows and "naive/zeroengine beyond gate+experts (paired)" in r
        base = rows["gate+experts"]["median_s"]
        ours = rows["zeroengine"]["median_s"] - base
        got = r["naive/zeroengine beyond gate+experts"]
        if ours > 0.1 * base:
            assert math.isclose(got, (rows["naive"]["median_s"] - base) / ours)
        else:  # too close to the shared row for a ratio
            assert got is None
    assert "bound/zeroengine" in result["mlp_ratios"][0] and len(result["load_average_start"]) == 3
    # AutoEP's layer against its grouped-GEMM bound, per shape
    assert len(result["autoep_ratios"]) == 4 and all(r["autoep-bound/autoep"] > 0 for r in result["autoep_ratios"])
    assert result["a2a"]["2"]["all_to_all_s"] > 0 and result["a2a"]["2"]["bytes_sent_per_rank"] > 0
