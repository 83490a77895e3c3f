"""``fp16`` and ``bf16``: which 16-bit format training runs in, and fp16's loss scaler.

The fp16 keys and defaults are DeepSpeed's, so a DeepSpeed loss-scaler setup
behaves the same: ``loss_scale: 0`` means dynamic scaling starting at
``2**initial_scale_power``.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from ..base import ConfigModel, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, rule_error


class FP16Config(ConfigModel):
    """Mixed precision with float16 parameters/gradients and an fp32 master copy."""

    enabled: bool = Field(False, description="Train in float16 mixed precision (16-bit params and grads, "
                                             "fp32 master weights and optimizer states).")
    auto_cast: bool = Field(False, description="Cast floating-point inputs of the model's forward (also inside "
                                               "lists, tuples and dicts) to float16; off, inputs reach the model "
                                               "as given (as in DeepSpeed; bf16 never casts inputs).")
    loss_scale: NonNegativeFloat = Field(0.0, description="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: NonNegativeInt = Field(
        16, le=127, description="Dynamic scaling starts at a loss scale of 2**initial_scale_power (at most 127: "
                                "2**128 is not a float32).")
    loss_scale_window: PositiveInt = Field(
        1000, description="Steps without overflow after which the dynamic loss scale is doubled.")
    hysteresis: PositiveInt = Field(
        2, description="The dynamic loss scale is lowered at this many overflows (1: at the first; the default "
                       "2 tolerates one).")
    consecutive_hysteresis: bool = Field(
        False, description="Refill the hysteresis budget after every step without overflow, "
                           "so only consecutive overflows lower the scale.")
    min_loss_scale: PositiveFloat = Field(1.0, description="Floor for the dynamic loss scale (unused with a static "
                                                           "loss_scale).")

    @model_validator(mode="after")
    def _start_at_or_above_the_floor(self) -> "FP16Config":
        if self.loss_scale == 0 and 2.0 ** self.initial_scale_power < self.min_loss_scale:
            raise rule_error(f"the dynamic loss scale would start at 2**initial_scale_power = "
                             f"{2.0 ** self.initial_scale_power:g}, below min_loss_scale = {self.min_loss_scale:g}",
                             ("initial_scale_power",))
        return self


class BF16Config(ConfigModel):
    """Mixed precision with bfloat16 parameters/gradients; needs no loss scaling."""

    enabled: bool = Field(False, description="Train in bfloat16 mixed precision (16-bit params and grads, "
                                             "fp32 master weights and optimizer states).")
    check_grad_overflow: bool = Field(
        True, description="Skip (on every rank) an optimizer step whose gradients are not finite, instead of "
                          "writing inf/nan into the weights; DeepSpeed's default.")
    bf16_master_weights_and_grads: bool = Field(
        False, description="ZeRO stages 1-3: no fp32 master copy; the optimizer steps the bf16 parameters with bf16 "
                           "gradients (its arithmetic in fp32, each result rounded to bf16). Saves 4 bytes per "
                           "parameter; with Adam/AdamW only. With offload_optimizer (device cpu) the C++ CPU Adam steps "
                           "the offloaded bf16 chunks.")
    bf16_optimizer_states: bool = Field(
        False, description="Adam's moments in bf16 (4 bytes per parameter instead of 8); needs "
                           "bf16_master_weights_and_grads, as in DeepSpeed.")

    @model_validator(mode="after")
    def _states_need_masters(self) -> "BF16Config":
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise rule_error("bf16_optimizer_states needs bf16_master_weights_and_grads (as in DeepSpeed)",
                             ("bf16_optimizer_states",))
        return self
