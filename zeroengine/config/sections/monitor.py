"""``monitor``: where training metrics (loss, lr, loss scale) are written.

DeepSpeed spells these as top-level ``csv_monitor`` and ``tensorboard`` blocks;
``legacy.py`` moves those here, so both spellings load.
"""
from __future__ import annotations

from pydantic import Field

from ..base import ConfigModel


class MonitorBackendConfig(ConfigModel):
    """One metrics writer."""

    enabled: bool = Field(False, description="Write metrics with this backend.")
    output_path: str = Field("", description="Directory for the output ('' : the current directory).")
    job_name: str = Field("zeroengine", description="Sub-directory (and run name) for this job.")


class MonitorConfig(ConfigModel):
    """Metrics writers; DeepSpeed's top-level csv_monitor / tensorboard blocks land here."""

    csv: MonitorBackendConfig = Field(default_factory=MonitorBackendConfig,
                                      description="CSV files, one per metric (DeepSpeed: csv_monitor).")
    tensorboard: MonitorBackendConfig = Field(default_factory=MonitorBackendConfig,
                                              description="TensorBoard event files (needs the tensorboard "
                                                          "package).")

    @property
    def enabled(self) -> bool:
        return self.csv.enabled or self.tensorboard.enabled
