"""Smoke test of benchmarks/bench_compressed_activations.py: --quick trains every variant of both models and writes
JSON with finite numbers; bf16 must keep well under the fp32 bytes for backward. No timing is asserted."""
import math

from bench_runs import run_benchmark


def test_quick_run_reports_every_variant(tmp_path):
    _, result = run_benchmark("bench_compressed_activations.py", tmp_path / "ca.json", "--quick", timeout=120)
    rows = {(res["model"], row["variant"]): row for res in result["results"] for row in res["variants"]}
    assert set(rows) == {("llama", v) for v in ("none", "none+noise", "bf16", "fp8")} | {
        ("llama-relu", v) for v in ("none", "bitmask", "fp8", "fp8+bitmask")}
    for key, row in rows.items():
        for k in ("held_for_backward_bytes", "peak_bytes", "held_ratio", "peak_ratio", "grad_rel_error",
                  "grad_rel_error_trained", "final_loss", "max_abs_loss_diff", "mean_abs_loss_diff", "median_step_s",
                  "step_time_ratio"):
            assert math.isfinite(row[k]) and row[k] >= 0, (key, k)
        assert len(row["losses"]) == result["settings"]["steps"]
        assert ("compressed" in row) == (key[1] not in ("none", "none+noise", "bitmask")), key
    none, bf16 = rows["llama", "none"], rows["llama", "bf16"]
    assert bf16["held_for_backward_bytes"] < 0.6 * none["held_for_backward_bytes"]
    assert bf16["compressed"]["stored_bytes"] * 2 == bf16["compressed"]["original_bytes"]
    assert none["max_abs_loss_diff"] == 0 and rows["llama-relu", "bitmask"]["relu_modules_swapped"] == 2
    # The bit mask is exact; compression's gradient error grows as the dtype narrows (bf16 2^-8, fp8 2^-4).
    bitmask = rows["llama-relu", "bitmask"]
    assert bitmask["grad_rel_error"] == bitmask["grad_rel_error_trained"] == 0
    assert 0 < bf16["grad_rel_error"] < rows["llama", "fp8"]["grad_rel_error"]
