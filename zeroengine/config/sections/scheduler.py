"""``scheduler``: ``{type, params}`` for DeepSpeed's learning-rate schedules.

As for the optimizer, ``params`` keeps only the keys the user wrote: the
schedules in ``zeroengine.optim.schedulers`` apply DeepSpeed's defaults, which
the per-type models below document. Keys a schedule cannot run without
(``total_num_steps``, OneCycle's lr range) are required here, so a missing one
is reported when the config is loaded rather than when training starts.
"""
from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Type, Union

from pydantic import Field, PlainValidator, field_validator, model_validator

from ..base import ConfigModel, Fraction, Int, NonNegativeFloat, NonNegativeInt, PositiveInt, rule_error
from ..errors import closest
from ..translate import validate_given_keys


def _rate_or_rates(value: Any) -> Any:
    """A non-negative number, or a list of them (one per optimizer param group)."""
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
            raise ValueError("expected a non-negative number or a list of them (one per param group), "
                             f"got {value!r}")
    return [float(v) for v in value] if isinstance(value, list) else float(value)


PerGroup = Annotated[Union[float, List[float]], PlainValidator(_rate_or_rates)]
WarmupType = Literal["log", "linear"]

_WARMUP_NUM_STEPS = Field(1000, description="Steps of warmup.")
_WARMUP_TYPE = Field("log", description="Shape of the warmup: 'log' or 'linear'.")
_TOTAL_NUM_STEPS = Field(description="Total training steps (required; 'auto' cannot be resolved "
                                     "outside a trainer).")
_LAST_BATCH_ITERATION = Field(-1, ge=-1, description="Optimizer steps already taken minus one, to start the "
                                                     "schedule part-way (-1: from the start).")


class WarmupLRParams(ConfigModel):
    """``WarmupLR``: warm up from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: PerGroup = Field(0.0, description="Learning rate at the start of warmup.")
    warmup_max_lr: Optional[PerGroup] = Field(None, description="Learning rate at the end of warmup "
                                                                "(null: each param group's own lr).")
    warmup_num_steps: NonNegativeInt = _WARMUP_NUM_STEPS
    warmup_type: WarmupType = _WARMUP_TYPE
    last_batch_iteration: Int = _LAST_BATCH_ITERATION


class WarmupDecayLRParams(WarmupLRParams):
    """``WarmupDecayLR``: WarmupLR, then linear decay to 0 at total_num_steps."""

    warmup_max_lr: Optional[PerGroup] = Field(0.001, description="Learning rate at the end of warmup "
                                                                 "(null: each param group's own lr).")
    total_num_steps: PositiveInt = _TOTAL_NUM_STEPS

    @model_validator(mode="after")
    def _warmup_fits(self) -> "WarmupDecayLRParams":
        _check_warmup_fits(self)
        return self


class WarmupCosineLRParams(ConfigModel):
    """``WarmupCosineLR``: warm up to the optimizer's lr, then cosine-decay to cos_min_ratio of it."""

    total_num_steps: PositiveInt = _TOTAL_NUM_STEPS
    warmup_min_ratio: Fraction = Field(0.0, description="Starting lr as a fraction of the optimizer's lr.")
    warmup_num_steps: NonNegativeInt = _WARMUP_NUM_STEPS
    cos_min_ratio: Fraction = Field(0.0001, description="Final lr as a fraction of the optimizer's lr.")
    warmup_type: WarmupType = _WARMUP_TYPE
    last_batch_iteration: Int = _LAST_BATCH_ITERATION

    @model_validator(mode="after")
    def _warmup_fits(self) -> "WarmupCosineLRParams":
        _check_warmup_fits(self)
        return self


class OneCycleParams(ConfigModel):
    """``OneCycle``: the 1cycle policy (lr up then down, momentum the other way), then decay."""

    cycle_min_lr: PerGroup = Field(description="Lowest lr of the cycle (required).")
    cycle_max_lr: PerGroup = Field(description="Highest lr of the cycle (required).")
    decay_lr_rate: NonNegativeFloat = Field(0.0, description="Lr decay rate after the cycle.")
    cycle_first_step_size: PositiveInt = Field(2000, description="Steps of the rising half of the cycle.")
    cycle_second_step_size: Optional[NonNegativeInt] = Field(
        None, description="Steps of the falling half (null: same as cycle_first_step_size; 0: no falling half).")
    cycle_first_stair_count: NonNegativeInt = Field(0, description="Stairs in the rising half (0: smooth).")
    cycle_second_stair_count: Optional[NonNegativeInt] = Field(
        None, description="Stairs in the falling half (null: same as cycle_first_stair_count).")
    decay_step_size: NonNegativeInt = Field(0, description="Steps between decays after the cycle.")
    cycle_momentum: bool = Field(True, description="Cycle Adam's beta1 inversely to the lr (beta2 set to 0.99, "
                                                   "as in DeepSpeed); an optimizer without betas, such as SGD, "
                                                   "keeps its own momentum (a warning says so).")
    cycle_min_mom: PerGroup = Field(0.8, description="Lowest momentum of the cycle.")
    cycle_max_mom: PerGroup = Field(0.9, description="Highest momentum of the cycle.")
    decay_mom_rate: NonNegativeFloat = Field(0.0, description="Momentum decay rate after the cycle.")
    last_batch_iteration: Int = _LAST_BATCH_ITERATION


def _check_warmup_fits(params: ConfigModel) -> None:
    # The schedules reject this too, but only once training starts.
    if params.total_num_steps < params.warmup_num_steps:
        default = "" if "warmup_num_steps" in params.model_fields_set else ", the default"
        raise rule_error(f"total_num_steps ({params.total_num_steps}) must be >= warmup_num_steps "
                         f"({params.warmup_num_steps}{default})", ("total_num_steps",))


SCHEDULER_PARAMS: Dict[str, Type[ConfigModel]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams,
}


class SchedulerConfig(ConfigModel):
    """The learning-rate schedule zeroengine builds (leave out to pass your own to initialize())."""

    type: str = Field(description="One of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle.")
    params: Dict[str, Any] = Field(default_factory=dict,
                                   description="Arguments of the schedule; the keys depend on type (see below).")

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        for name in SCHEDULER_PARAMS:
            if value.lower() == name.lower():
                return name
        match = closest(value, SCHEDULER_PARAMS)
        hint = f"did you mean '{match}'? " if match else ""
        raise ValueError(f"unknown scheduler type {value!r}; {hint}valid types: {', '.join(SCHEDULER_PARAMS)} "
                         "(or pass your own lr_scheduler to zeroengine.initialize)")

    @model_validator(mode="after")
    def _check_params(self) -> "SchedulerConfig":
        self.params = validate_given_keys(SCHEDULER_PARAMS[self.type], self.params, ("scheduler", "params"))
        return self
