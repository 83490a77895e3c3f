"""benchmarks/bench_optimizers.py --quick runs every optimizer and reports what it should: each optimizer's state
bytes per parameter as memory_breakdown counts them (AdamW 8, Muon 4 for its matrices and 8 for the rest,
Adafactor and SM3 far less than Adam's), and a held-out loss below the untrained model's ln(256)."""
import json
import math

from bench_runs import run_benchmark


def test_bench_optimizers_quick(tmp_path):
    out = tmp_path / "optimizers.json"
    run_benchmark("bench_optimizers.py", out, "--quick", "--plot", str(tmp_path / "o.png"))
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"AdamW", "Adafactor", "SM3", "Muon"}
    assert summary["AdamW"]["state_bytes_per_param"] == 8.0
    assert 4.0 < summary["Muon"]["state_bytes_per_param"] < 8.0
    assert summary["Adafactor"]["state_bytes_per_param"] < 1.0 and summary["SM3"]["state_bytes_per_param"] < 5.0
    assert all(s["held_out_mean"] < math.log(256) for s in summary.values())
    assert (tmp_path / "o.png").stat().st_size > 0
