"""``activation_checkpointing``: how ``zeroengine.checkpointing.checkpoint`` stores activations.

The same six keys as DeepSpeed. They configure the recompute machinery, which
only acts where the model calls ``zeroengine.checkpointing.checkpoint``.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from ..base import ConfigModel, PositiveInt, rule_error


class ActivationCheckpointingConfig(ConfigModel):
    """Options for activation recomputation."""

    partition_activations: bool = Field(False, description="Split each saved activation across model-parallel "
                                                           "ranks instead of keeping a copy on each.")
    cpu_checkpointing: bool = Field(False, description="Move saved (partitioned) activations to CPU memory.")
    contiguous_memory_optimization: bool = Field(
        False, description="Copy saved activations into one preallocated buffer to avoid fragmentation; "
                           "needs partition_activations and number_checkpoints.")
    number_checkpoints: Optional[PositiveInt] = Field(
        None, description="Checkpoints per forward pass; sizes the contiguous buffer.")
    synchronize_checkpoint_boundary: bool = Field(
        False, description="Synchronize the device at each checkpoint boundary (for timing).")
    profile: bool = Field(False, description="Time the forward and recompute of each checkpoint.")

    @model_validator(mode="after")
    def _contiguous_needs_partitioning(self) -> "ActivationCheckpointingConfig":
        # Same requirements as DeepSpeed's checkpointing.configure().
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise rule_error("contiguous_memory_optimization needs partition_activations=true",
                             ("contiguous_memory_optimization",))
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise rule_error("contiguous_memory_optimization needs number_checkpoints",
                             ("number_checkpoints",))
        return self
