"""The ``monitor`` config section builds the writers it names, where it says, on rank 0 only."""
import os

import pytest

from zeroengine.config import ConfigError, load_config
from zeroengine.monitor import CsvMonitor, TensorBoardMonitor, build_recorder
from zeroengine.monitor.recorder import output_directory


def _cfg(**extra):
    return load_config({"train_micro_batch_size_per_gpu": 1, **extra})


def _kinds(recorder):
    return sorted(type(m).__name__ for m in recorder.master.monitors)


def test_disabled_by_default_builds_nothing_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert build_recorder(_cfg().monitor, rank=0) is None
    assert build_recorder(_cfg(monitor={"csv": {"enabled": False, "output_path": "x"}}).monitor, rank=0) is None
    assert os.listdir(tmp_path) == []


def test_deepspeed_nested_shape(tmp_path):
    cfg = _cfg(monitor={"csv": {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "run1"},
                        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run1"}})
    recorder = build_recorder(cfg.monitor, rank=0)
    try:
        assert _kinds(recorder) == ["CsvMonitor", "TensorBoardMonitor"]
        csv_monitor, tb_monitor = recorder.master.monitors
        assert os.path.dirname(csv_monitor.path) == str(tmp_path / "logs" / "run1")
        assert os.path.dirname(tb_monitor.path) == str(tmp_path / "tb" / "run1")
        assert os.path.isfile(tb_monitor.path)  # the file_version record is written at start
    finally:
        recorder.close()


def test_deepspeed_top_level_spellings(tmp_path):
    cfg = _cfg(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "legacy"},
               tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "legacy"})
    recorder = build_recorder(cfg.monitor, rank=0)
    try:
        assert _kinds(recorder) == ["CsvMonitor", "TensorBoardMonitor"]
        assert all(os.path.dirname(m.path) == str(tmp_path / "legacy") for m in recorder.master.monitors)
    finally:
        recorder.close()


def test_only_one_backend(tmp_path):
    cfg = _cfg(monitor={"tensorboard": {"enabled": True, "output_path": str(tmp_path)}})
    recorder = build_recorder(cfg.monitor, rank=0)
    try:
        assert _kinds(recorder) == ["TensorBoardMonitor"]
        # the default run name; not "zeroengine", which would shadow the package in the working directory
        assert os.listdir(tmp_path / "zeroengine_run") == [os.path.basename(recorder.master.monitors[0].path)]
    finally:
        recorder.close()


def test_other_ranks_get_a_recorder_without_writers(tmp_path):
    # They still need one: every rank joins the per-step loss all-reduce.
    cfg = _cfg(monitor={"csv": {"enabled": True, "output_path": str(tmp_path)},
                        "tensorboard": {"enabled": True, "output_path": str(tmp_path)}})
    recorder = build_recorder(cfg.monitor, rank=1)
    assert recorder is not None and not recorder.master.active
    assert os.listdir(tmp_path) == []


def test_empty_output_path_is_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    backend = _cfg(monitor={"csv": {"enabled": True, "job_name": "j"}}).monitor.csv
    assert output_directory(backend) == str(tmp_path / "j")
    monkeypatch.chdir("/")
    assert output_directory(_cfg(monitor={"csv": {"output_path": "rel"}}).monitor.csv) == "/rel/zeroengine_run"


@pytest.mark.parametrize("writer", [CsvMonitor, TensorBoardMonitor])
def test_writers_create_missing_directories(tmp_path, writer):
    writer(str(tmp_path / "a" / "b")).close()
    assert os.path.isdir(tmp_path / "a" / "b")


def test_an_output_path_that_cannot_be_written_is_a_config_error_naming_the_key(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = _cfg(monitor={"csv": {"enabled": True, "output_path": str(blocker)}})
    with pytest.raises(ConfigError, match="monitor.csv.output_path: cannot write the csv monitor's files under"):
        build_recorder(cfg.monitor, rank=0)
