"""Smoke test of benchmarks/bench_nvme.py: --quick builds and trains the model with both offloads in host memory
and on the drive (the same loss: the swap moves bytes, never changes them), reports where the bytes are and what
the swap moved, and measures the I/O op. No timing is asserted."""
import math

from bench_runs import run_benchmark


def test_quick_run_reports_memory_swap_and_io(tmp_path):
    _, result = run_benchmark("bench_nvme.py", tmp_path / "nvme.json", "--quick", "--dir", str(tmp_path))
    cpu, nvme = result["memory"]["cpu"], result["memory"]["nvme"]
    assert cpu["loss"] == nvme["loss"] and cpu["params"] == nvme["params"] == result["model"]["params"] > 0
    assert cpu["memory_breakdown"]["nvme"] == 0 < nvme["memory_breakdown"]["nvme"]
    assert nvme["memory_breakdown"]["nvme"] >= 14 * nvme["params"]  # fp32 masters, both moments, the bf16 weights
    assert set(nvme["swap"]) == {"optimizer", "params (flat_params)"}
    assert all(s["read_bytes"] > 0 and s["written_bytes"] > 0 for s in nvme["swap"].values())
    assert result["swap"]["bytes_moved"] > 0 and 0 <= result["swap"]["wait_share_of_step"]
    assert all(math.isfinite(v) and v > 0 for v in result["growth_per_param"].values())
    io = result["io"]
    assert io["op"]["write_GBps"] > 0 and io["op"]["read_GBps"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["nvme.json"]  # the swap and I/O files are gone
