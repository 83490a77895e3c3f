"""Smoke test of benchmarks/bench_pipeline.py: --quick (p = 2, m = 4 and 8, GPipe, 1F1B and interleaved 1F1B, a
tiny model, DeepSpeed skipped) runs and writes JSON of the expected shape. The activations each schedule holds are
exact and asserted; timings and bubble fractions only have to be fractions."""
import math

from bench_runs import run_benchmark


def test_quick_run_reports_bubbles_and_activations(tmp_path):
    stdout, result = run_benchmark("bench_pipeline.py", tmp_path / "pipeline.json", "--quick", "--no-deepspeed",
                                   timeout=120)
    assert "gpipe/1f1b" in stdout and "formula" in stdout
    runs = {(r["stages"], r["micro_batches"], r["schedule"]): r for r in result["runs"]}
    assert set(runs) == {(2, m, s) for m in (4, 8) for s in ("gpipe", "1f1b", "interleaved")}
    for (p, m, schedule), r in runs.items():
        b = r["bubble"]
        assert len(b["per_stage"]) == p and all(0 <= x < 1 for x in b["per_stage"]), b
        assert 0 <= b["measured"] < 1 and 0 <= b["makespan"] < 1, b
        v = 2 if schedule == "interleaved" else 1
        assert r["virtual_stages"] == v and math.isclose(b["formula"], (p - 1) / (v * m + p - 1))
        assert math.isclose(b["simulated"], b["formula"])  # equal pass times on every stage: the textbook value
        # exact: GPipe holds every micro-batch, 1F1B min(p - s, m) on stage s, interleaved its warm-up plus one
        expected = {"gpipe": [m] * p, "1f1b": [min(p - s, m) for s in range(p)],
                    "interleaved": [min(2 * (p - s - 1) + (v - 1) * p + 1, v * m) for s in range(p)]}[schedule]
        assert r["max_in_flight"] == expected == r["expected_max_in_flight"], (p, m, schedule, r["max_in_flight"])
        assert r["step_s"] > 0 and len(r["step_s_runs"]) == result["steps"] == 2
        assert all(t > 0 for t in r["schedule_s_per_stage"]) and all(w >= 0 for w in r["recv_wait_s_per_stage"])
        assert all(x > 0 for x in r["peak_saved_bytes"]) and all(math.isfinite(x) for x in r["losses"])
        assert r["oversubscribed"] is False
    # same weights, data and optimizer: every schedule follows the same losses (each parameter's micro-batch
    # gradients are summed in the same order under all three)
    for m in (4, 8):
        assert runs[(2, m, "gpipe")]["losses"] == runs[(2, m, "1f1b")]["losses"] == \
            runs[(2, m, "interleaved")]["losses"]
    for mem in result["memory"]:
        m = mem["micro_batches"]
        for s in mem["per_stage"]:
            assert (s["gpipe_in_flight"], s["1f1b_in_flight"]) == (m, min(2 - s["stage"], m))
            assert s["ratio"] == s["gpipe_bytes"] / s["1f1b_bytes"] and s["ratio"] > 1
    assert result["deepspeed"] == {"skipped": "--no-deepspeed"}
