"""Smoke test of benchmarks/bench_long_context.py: --quick (a tiny Llama, 128 and 256 tokens measured, the ALST
ladder's bottom and top rungs (the middle ones differ from the top only by flags, and a launch each costs ~10 s),
each searching its longest length within a 6 MiB budget) runs and writes JSON of the
expected shape. Every rung trains the same model on the same sequences up to its search, so the measured steps'
losses agree (sequence parallelism and tiling are exact); each rung's memory per token is below the previous
rung's, and its longest length within the budget is not shorter."""
import math

import pytest
from bench_runs import run_benchmark

pytest.importorskip("transformers")
RUNGS = ["sp1", "sp2+tiled+ckpt"]


def test_quick_run_climbs_the_ladder(tmp_path):
    stdout, result = run_benchmark("bench_long_context.py", tmp_path / "long_context.json", "--quick", "--rungs", ",".join(RUNGS),
                                    timeout=180)
    assert "longest within 6 MiB" in stdout
    budget, granularity = result["settings"]["budget"], result["settings"]["granularity"]
    measured = {(r["rung"], r["seq"]): r for r in result["rows"] if not r.get("search")}
    assert set(measured) == {(rung, seq) for rung in RUNGS for seq in (128, 256)}
    for r in result["rows"]:
        assert r["ranks"] == (1 if r["rung"] == "sp1" else 2)
        assert r["peak_activation_bytes"] > 0 and r["model_state_bytes"] > 0 and r["seconds"] > 0
        assert r["peak_bytes"] >= r["peak_activation_bytes"] + r["model_state_bytes"] + r["kept_buffer_bytes"]
        assert math.isfinite(r["loss"])
    for (rung, seq), r in measured.items():
        # the same model, data and steps on every rung: the same loss (summation orders differ in the last bits)
        assert r["loss"] == pytest.approx(measured[("sp1", seq)]["loss"], abs=1e-4), (rung, seq)
    summary = result["summary"]
    slopes = [summary[rung]["bytes_per_token"] for rung in RUNGS]
    assert all(later < earlier for earlier, later in zip(slopes, slopes[1:])), slopes
    longest = [summary[rung]["longest_in_budget"] for rung in RUNGS]
    assert longest[0] is not None and all(later >= earlier for earlier, later in zip(longest, longest[1:])), longest
    assert longest[-1] > longest[0]
    for rung in RUNGS:  # the search's answer is what its steps showed
        steps = [r for r in result["rows"] if r["rung"] == rung]
        assert summary[rung]["longest_in_budget"] == max(r["seq"] for r in steps if r["peak_bytes"] <= budget)
        over = [r["seq"] for r in steps if r["peak_bytes"] > budget]
        assert summary[rung]["first_over_budget"] == min(over)
        assert summary[rung]["stopped"] == "narrowed" and min(over) - longest[RUNGS.index(rung)] <= granularity
