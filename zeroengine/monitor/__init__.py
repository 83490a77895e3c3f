"""Training metrics to CSV and TensorBoard event files (the config's ``monitor`` section).

See docs/monitoring.md. The engine calls :meth:`StepRecorder.record_step` once
per optimizer step; ``python -m zeroengine.monitor.plot RUN_DIR`` draws the CSV.
"""
from .base import Monitor, MonitorMaster, StepRecord
from .csv_monitor import CsvMonitor
from .recorder import StepRecorder, build_recorder
from .tensorboard import TensorBoardMonitor, read_event_file, read_scalars

__all__ = ["Monitor", "MonitorMaster", "StepRecord", "CsvMonitor", "TensorBoardMonitor", "StepRecorder",
           "build_recorder", "read_event_file", "read_scalars"]
