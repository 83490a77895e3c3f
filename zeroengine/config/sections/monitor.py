"""``monitor``: where training metrics (loss, lr, loss scale, throughput, memory, comm bytes) are written.

The writers live in :mod:`zeroengine.monitor` (see docs/monitoring.md).

DeepSpeed spells these as top-level ``csv_monitor`` and ``tensorboard`` blocks;
``legacy.py`` moves those here, so both spellings load.
"""
from __future__ import annotations

from pydantic import Field

from ..base import ConfigModel


class MonitorBackendConfig(ConfigModel):
    """One metrics writer."""

    enabled: bool = Field(False, description="Write metrics with this backend.")
    output_path: str = Field("", description="Directory for the output ('': the current directory).")
    # Not "zeroengine": a folder of that name in the working directory would shadow the package for the
    # next script run from there (an editable install finds it first).
    job_name: str = Field("zeroengine_run", description="Sub-directory of output_path the files go in "
                                                        "(the run's name).")


class MonitorConfig(ConfigModel):
    """Metrics writers; DeepSpeed's top-level csv_monitor / tensorboard blocks land here."""

    csv: MonitorBackendConfig = Field(default_factory=MonitorBackendConfig,
                                      description="One metrics.csv: a row per optimizer step, a column per "
                                                  "metric (DeepSpeed: csv_monitor).")
    tensorboard: MonitorBackendConfig = Field(default_factory=MonitorBackendConfig,
                                              description="A TensorBoard event file (written directly: "
                                                          "the tensorboard package is needed only to view it).")

    @property
    def enabled(self) -> bool:
        return self.csv.enabled or self.tensorboard.enabled
