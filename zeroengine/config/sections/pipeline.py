"""``pipeline``: DeepSpeed's pipeline keys, and the schedule zeroengine runs (zeroengine/pipe).

The model's own :class:`zeroengine.pipe.PipelineModule` arguments decide its stages, partition, seeding and
activation checkpointing, as in DeepSpeed (whose engine reads only some of these keys); here ``stages``, when
a number, must agree with the module's ``num_stages``. ``schedule`` is zeroengine's: DeepSpeed runs 1F1B only
(and has no virtual stages).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from ..base import ConfigModel, NonNegativeInt, PositiveInt


class PipelineConfig(ConfigModel):
    """Pipeline parallelism (engine.train_batch) for a zeroengine.pipe.PipelineModule."""

    stages: Union[Literal["auto"], PositiveInt] = Field(
        "auto", description="Pipeline stages; \"auto\": the PipelineModule's num_stages (a number must equal it).")
    partition: str = Field("best", description="DeepSpeed's key; the PipelineModule's partition_method decides.")
    seed_layers: bool = Field(False, description="DeepSpeed's key; the PipelineModule's seed_layers decides.")
    activation_checkpoint_interval: NonNegativeInt = Field(
        0, description="DeepSpeed's key; the PipelineModule's activation_checkpoint_interval decides.")
    pipe_partitioned: bool = Field(
        True, description="Accepted, no effect: each tensor-parallel rank sends its stage's whole activations to the "
                          "same tensor-parallel rank of the next stage. (DeepSpeed, under tensor parallelism, sends "
                          "each rank's 1/tp slice and all-gathers them on arrival: less traffic, the same values.)")
    grad_partitioned: bool = Field(True, description="Accepted, no effect: the gradients of activations travel back "
                                                     "whole, as pipe_partitioned says of the activations.")
    schedule: Literal["1f1b", "gpipe", "interleaved"] = Field(
        "1f1b", description="The micro-batch order: \"1f1b\" (one forward, one backward: a stage holds at most "
                            "as many micro-batches as stages follow it) or \"gpipe\" (all forwards, then all "
                            "backwards: a stage holds every micro-batch); both idle (p-1)/(m+p-1) of a step. "
                            "\"interleaved\" (Megatron's interleaved 1F1B, for a PipelineModule with "
                            "virtual_stages v > 1, which runs it under \"1f1b\" too) idles (p-1)/(v·m+p-1); "
                            "it needs gradient_accumulation_steps divisible by the stages.")
