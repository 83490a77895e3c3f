"""ze_plot: a monitor CSV to a PNG; a clear message when matplotlib is missing."""
import sys

import pytest

from zeroengine.monitor import CsvMonitor, StepRecord
from zeroengine.monitor.plot import main, read_metrics


def _write_run(directory, steps=5, start=1):
    monitor = CsvMonitor(str(directory))
    for step in range(start, start + steps):
        monitor.write(StepRecord(step=step, samples=8 * step, wall_time=float(step), metrics={
            "train/loss": 5.0 / step, "train/lr": 1e-3, "train/samples_per_sec": 100.0 + step,
            "memory/params": 2**20, "memory/optimizer_states": 2**21, "memory/grads": 0, "memory/cpu": 3 * 2**20}))
    monitor.close()
    return monitor.path


def test_read_metrics_keeps_the_latest_row_per_step(tmp_path):
    _write_run(tmp_path, steps=4)          # steps 1..4
    _write_run(tmp_path, steps=3, start=3)  # resumed from step 2: steps 3..5 appended
    metrics = read_metrics(str(tmp_path / "metrics.csv"))
    assert metrics["step"] == [1, 2, 3, 4, 5]
    assert metrics["train/loss"] == pytest.approx([5.0, 2.5, 5 / 3, 1.25, 1.0])
    assert metrics["memory/params"] == [2**20] * 5


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _write_run(tmp_path)
    out = tmp_path / "out.png"
    assert main([str(tmp_path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "5 steps" in capsys.readouterr().out


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    _write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert main([str(tmp_path), "-o", str(tmp_path / "out.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()


def test_missing_csv_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "monitor.csv" in capsys.readouterr().err


def test_a_csv_of_another_tool_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_text("step,lr\n1,0.001\n")  # e.g. DeepSpeed's Train_Samples_lr.csv
    assert main([str(tmp_path / "metrics.csv")]) == 1
    assert "not a zeroengine monitor CSV" in capsys.readouterr().err
