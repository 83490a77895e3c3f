"""``zero_optimization``: which model states are partitioned across data-parallel ranks.

Stage 1 partitions optimizer states, stage 2 also gradients, stage 3 also the
parameters. Key names and defaults follow DeepSpeed's ``DeepSpeedZeroConfig``;
the deprecated spellings (``cpu_offload``, ``stage3_gather_fp16_...``) are
rewritten in ``legacy.py`` before this model sees the config.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ..base import ConfigModel, Int, NonNegativeInt, PositiveInt, rule_error
from .offload import OffloadOptimizerConfig, OffloadParamConfig

_STAGE3 = "Stage 3 only. "


class ZeroConfig(ConfigModel):
    """ZeRO partitioning and its communication buckets."""

    stage: Int = Field(0, description="0: plain data parallel; 1: partition optimizer states; "
                                      "2: also gradients; 3: also parameters.")
    contiguous_gradients: bool = Field(True, description="Accepted at either value, no effect: stages 1-3 always "
                                                         "copy gradients into contiguous bucket buffers as they "
                                                         "are produced.")
    overlap_comm: Optional[bool] = Field(
        None, description="Overlap gradient reduction with the backward pass. Not set: true at stage 3, "
                          "false otherwise (as in DeepSpeed).")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter rather than "
                                                   "all-reduce.")
    reduce_bucket_size: PositiveInt = Field(500_000_000, description="Elements reduced per gradient bucket. "
                                                                     "'auto': hidden_size squared.")
    allgather_bucket_size: PositiveInt = Field(500_000_000, description="Accepted, no effect: updated "
                                                                        "parameters are all-gathered in the "
                                                                        "reduce_bucket_size buckets.")
    allgather_partitions: bool = Field(True, description="All-gather updated partitions after the step; "
                                                         "only true is supported.")
    load_from_fp32_weights: bool = Field(True, description="On checkpoint load, rebuild 16-bit parameters from "
                                                           "the saved fp32 master weights; only true (the masters "
                                                           "are never rebuilt from 16-bit values).")
    elastic_checkpoint: bool = Field(False, description="Accepted for DeepSpeed compatibility; zeroengine "
                                                        "checkpoints always load into any world size and stage.")
    ignore_unused_parameters: bool = Field(True, description="Tolerate parameters that get no gradient in a "
                                                             "step (they get a zero gradient); only true.")
    round_robin_gradients: bool = Field(False, description="Accepted at either value, no effect (a DeepSpeed "
                                                           "performance hint for its gradient copies).")
    offload_optimizer: Optional[OffloadOptimizerConfig] = Field(
        None, description="Keep optimizer states on CPU and step there (stages 1-3).")
    offload_param: Optional[OffloadParamConfig] = Field(
        None, description="Keep parameter shards on CPU (stage 3 only).")
    sub_group_size: NonNegativeInt = Field(1_000_000_000, description="Accepted, no effect: zeroengine steps the "
                                                                      "optimizer one reduce bucket at a time, which "
                                                                      "already bounds the step's temporary memory "
                                                                      "(0, which axolotl's configs write, too).")
    stage3_prefetch_bucket_size: NonNegativeInt = Field(
        50_000_000, description=_STAGE3 + "Elements of parameters fetched ahead of use. "
                                          "'auto': 0.9 * hidden_size squared.")
    stage3_param_persistence_threshold: NonNegativeInt = Field(
        100_000, description=_STAGE3 + "Parameters smaller than this many elements stay gathered. "
                                       "'auto': 10 * hidden_size.")
    stage3_max_live_parameters: NonNegativeInt = Field(
        1_000_000_000, description=_STAGE3 + "Most elements kept gathered at once.")
    stage3_max_reuse_distance: NonNegativeInt = Field(
        1_000_000_000, description=_STAGE3 + "A parameter used again within this many elements "
                                             "of fetches is kept gathered.")
    stage3_fetch_unit: Literal["module", "block"] = Field(
        "module", description=_STAGE3 + "zeroengine's own key: what one fetch gathers. 'module': each module's "
                              "own parameters just before it runs (DeepSpeed's way). 'block': each block (a child "
                              "of the model's nn.ModuleLists, e.g. a transformer layer) gathers all its parameters "
                              "at once and its inner modules run without hooks, as an FSDP2 fully_shard'ed block: "
                              "fewer, larger gathers and much less Python work per step (350M GPT, one H100: "
                              "26.0% -> 31.7% MFU), one block's parameters gathered at a time. engine.compile() "
                              "always fetches by block.")
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description=_STAGE3 + "Gather the full 16-bit weights when saving, so the saved module "
                                     "state_dict is complete.")

    @field_validator("stage", mode="after")
    @classmethod
    def _known_stage(cls, value: int) -> int:
        if value not in (0, 1, 2, 3):
            raise ValueError(f"must be 0, 1, 2 or 3, got {value}")
        return value

    @field_validator("allgather_partitions", "load_from_fp32_weights", "ignore_unused_parameters", mode="after")
    @classmethod
    def _only_true(cls, value: bool, info) -> bool:
        if not value:
            what = {"allgather_partitions": "zeroengine always all-gathers the updated partitions after the step",
                    "load_from_fp32_weights": "checkpoints always restore the saved fp32 master weights",
                    "ignore_unused_parameters": "a parameter that gets no gradient in a step gets a zero "
                                                "gradient, never an error"}[info.field_name]
            raise ValueError(f"false is not supported: {what}; remove the key")
        return value

    @field_validator("offload_optimizer", "offload_param", mode="after")
    @classmethod
    def _device_none_means_no_offload(cls, value: Any) -> Any:
        return None if value is not None and value.device == "none" else value

    @model_validator(mode="after")
    def _stage_rules(self) -> "ZeroConfig":
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        if self.offload_param is not None and self.stage != 3:
            raise rule_error(f"parameter offload needs ZeRO stage 3 (stage is {self.stage}); set "
                             "zero_optimization.stage to 3 or remove offload_param", ("offload_param",))
        if self.offload_optimizer is not None and self.stage == 0:
            raise rule_error("optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0); set "
                             "zero_optimization.stage or remove offload_optimizer", ("offload_optimizer",))
        return self
