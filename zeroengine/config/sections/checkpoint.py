"""``checkpoint``: DeepSpeed's checkpoint options that zeroengine honours.

zeroengine stores shards by parameter name and flat range, so any checkpoint
loads into any world size and stage; that is why ``load_universal`` needs no
separate format here. DeepSpeed's writer/parallel-write tuning is listed in
``unsupported.py``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ..base import ConfigModel

TagValidation = Literal["Ignore", "Warn", "Fail"]


class CheckpointConfig(ConfigModel):
    """Checkpoint save/load behaviour."""

    tag_validation: TagValidation = Field(
        "Warn", description="What to do when ranks save under different tags: 'Ignore', 'Warn' or 'Fail' "
                            "(any capitalisation).")
    resume_data_position: bool = Field(
        True, description="load_checkpoint continues the loader initialize(training_data=...) returned where the "
                          "checkpoint stopped (its epoch and the samples already handed out), so a resumed run "
                          "trains what an uninterrupted one does. False: the loader starts its epoch over, as "
                          "DeepSpeed's does (for a script that skips consumed batches itself).")
    async_save: bool = Field(
        False, description="save_checkpoint copies the state to host memory and writes it in a background thread "
                           "while training goes on; 'latest' moves once every rank's files are on disk. The next "
                           "save, a load, engine.wait_for_checkpoint() and engine.destroy() wait for it.")
    load_universal: bool = Field(False, description="Accepted for DeepSpeed compatibility: every zeroengine "
                                                    "checkpoint is already universal (any world, any stage).")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        # DeepSpeed upper-cases this value before checking it.
        if isinstance(value, str):
            for mode in ("Ignore", "Warn", "Fail"):
                if value.lower() == mode.lower():
                    return mode
        return value
