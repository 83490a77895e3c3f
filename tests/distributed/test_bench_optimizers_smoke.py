"""benchmarks/bench_optimizers.py --quick reports what it should: each optimizer's state bytes per parameter as
memory_breakdown counts them (AdamW 8, Adafactor far less), a held-out loss below the untrained model's ln(256),
and the plot. (Two optimizers: the others run the same code; each is tested in test_matrix_optimizers.)"""
import json
import math

from bench_runs import run_benchmark


def test_bench_optimizers_quick(tmp_path):
    out = tmp_path / "optimizers.json"
    run_benchmark("bench_optimizers.py", out, "--quick", "--optimizers", "AdamW,Adafactor", "--plot",
                  str(tmp_path / "o.png"))
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"AdamW", "Adafactor"}
    assert summary["AdamW"]["state_bytes_per_param"] == 8.0
    assert summary["Adafactor"]["state_bytes_per_param"] < 1.0
    assert all(s["held_out_mean"] < math.log(256) for s in summary.values())
    assert (tmp_path / "o.png").stat().st_size > 0


def test_a_rate_sweep_and_appended_runs():
    """NAME@LR is NAME's section at another peak rate (Muon: its matrices'); --append replaces an earlier run of
    the same optimizer and seed and keeps the others, in seed order."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from bench_optimizers import merge_runs, optimizer_config

    assert optimizer_config("AdamW@1e-2")["params"]["lr"] == 1e-2
    assert optimizer_config("Muon@0.05")["params"]["muon_lr"] == 0.05
    assert optimizer_config("SM3") == {"type": "SM3", "params": {"lr": 0.05, "momentum": 0.9}}
    earlier = [{"optimizer": "AdamW", "seed": 0, "v": 1}, {"optimizer": "SM3", "seed": 0, "v": 2},
               {"optimizer": "AdamW", "seed": 1, "v": 3}]
    names, runs = merge_runs(earlier, [{"optimizer": "AdamW", "seed": 1, "v": 4}, {"optimizer": "SM3@0.1", "seed": 0,
                                                                                   "v": 5}])
    assert names == ["AdamW", "SM3", "SM3@0.1"]
    assert [r["v"] for r in runs] == [1, 2, 5, 4]
