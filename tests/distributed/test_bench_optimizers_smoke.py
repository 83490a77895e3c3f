"""benchmarks/bench_optimizers.py --quick reports what it should: each optimizer's state bytes per parameter as
memory_breakdown counts them (AdamW 8, Adafactor far less), a held-out loss below the untrained model's ln(256),
and the plot. (Two optimizers: the others run the same code; each is tested in test_matrix_optimizers.) A rate
sweep's run (NAME@LR) appended to the same file keeps the runs already there."""
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
    run_benchmark("bench_optimizers.py", out, "--quick", "--optimizers", "AdamW@1e-2", "--append", "--plot",
                  str(tmp_path / "o.png"))
    appended = json.loads(out.read_text())
    assert list(appended["summary"]) == ["AdamW", "Adafactor", "AdamW@1e-2"]
    assert appended["summary"]["Adafactor"] == summary["Adafactor"]
    assert appended["optimizers"]["AdamW@1e-2"]["params"]["lr"] == 1e-2
    assert appended["summary"]["AdamW@1e-2"]["held_out_mean"] != summary["AdamW"]["held_out_mean"]
