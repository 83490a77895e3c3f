"""``optimizer``: ``{type, params}``, with ``params`` checked against the chosen type.

``params`` stays a plain dict holding only the keys the user wrote (after
"auto" is resolved): the defaults belong to the optimizer constructors in
``zeroengine.optim``, which apply DeepSpeed's. The per-type models below exist
to reject unknown or mistyped keys up front and to document each type; their
defaults are the ones the optimizer factory applies.
"""
from __future__ import annotations

from typing import Annotated, Any, Dict, Optional, Tuple, Type

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from ..base import ConfigModel, NonNegativeFloat, rule_error
from ..errors import closest
from ..translate import validate_given_keys


def _pair(value: Any) -> Any:
    # JSON has no tuples: betas arrive as a list.
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"expected two numbers [beta1, beta2], got {list(value)!r}")
        return tuple(value)
    return value


Betas = Annotated[Tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]],
                  BeforeValidator(_pair)]

_LR = Field(1e-3, description="Learning rate.")
_BETAS = Field((0.9, 0.999), description="Coefficients [beta1, beta2] of the running averages of the "
                                         "gradient and its square.")
_EPS = Field(1e-8, gt=0, description="Term added to the denominator for numerical stability.")
_WEIGHT_DECAY = Field(0.0, description="Weight decay coefficient.")
_BIAS_CORRECTION = Field(True, description="Accepted for DeepSpeed compatibility; only true (torch's "
                                           "behaviour) is supported.")
_SET_GRAD_NONE = Field(True, description="FusedAdam's option, accepted for DeepSpeed compatibility; only true "
                                         "(gradients are released, not zeroed, as torch does) is supported.")
_FP32_STATES = Field(True, description="DeepSpeed CPU Adam's option, accepted for compatibility; only true "
                                       "(optimizer states in fp32, zeroengine's only layout) is supported.")


def _require_true(value: Any, info: ValidationInfo) -> Any:
    # DeepSpeed-only flags whose only supported value is torch's (and DeepSpeed's default) behaviour.
    if value is False:
        raise ValueError(f"{info.field_name}=false is not supported; remove it")
    return value


class AdamParams(ConfigModel):
    """``Adam``: DeepSpeed's default adam_w_mode=true makes this decoupled weight decay (AdamW)."""

    lr: NonNegativeFloat = _LR
    betas: Betas = _BETAS
    eps: float = _EPS
    weight_decay: NonNegativeFloat = _WEIGHT_DECAY
    amsgrad: bool = Field(False, description="Use the AMSGrad variant (torch implementation only).")
    adam_w_mode: bool = Field(True, description="Decoupled weight decay (AdamW). As in DeepSpeed, true by "
                                                "default for type Adam; false gives classic Adam with L2 decay.")
    torch_adam: bool = Field(False, description="Use torch.optim's implementation with torch's own defaults "
                                                "instead of the fused/CPU kernels.")
    fused: Optional[bool] = Field(None, description="torch.optim's fused implementation (null: torch decides).")
    foreach: Optional[bool] = Field(None, description="torch.optim's foreach implementation (null: torch "
                                                      "decides).")
    bias_correction: bool = _BIAS_CORRECTION
    set_grad_none: bool = _SET_GRAD_NONE
    fp32_optimizer_states: bool = _FP32_STATES

    _bias = field_validator("bias_correction", "set_grad_none", "fp32_optimizer_states", mode="before")(_require_true)


class AdamWParams(AdamParams):
    """``AdamW``: always decoupled weight decay, whatever adam_w_mode says (as in DeepSpeed)."""


class SGDParams(ConfigModel):
    """``SGD``: torch.optim.SGD."""

    lr: NonNegativeFloat = _LR
    momentum: NonNegativeFloat = Field(0.0, description="Momentum factor.")
    dampening: NonNegativeFloat = Field(0.0, description="Dampening for momentum.")
    weight_decay: NonNegativeFloat = _WEIGHT_DECAY
    nesterov: bool = Field(False, description="Nesterov momentum; needs momentum > 0 and dampening = 0.")
    fused: Optional[bool] = Field(None, description="torch.optim's fused implementation (null: torch decides).")
    foreach: Optional[bool] = Field(None, description="torch.optim's foreach implementation (null: torch "
                                                      "decides).")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "SGDParams":
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise rule_error("nesterov=true needs momentum > 0 and dampening = 0", ("nesterov",))
        return self


class CPUAdamParams(ConfigModel):
    """``CPUAdam``: zeroengine's vectorised CPU Adam (the optimizer step of ZeRO-Offload)."""

    lr: NonNegativeFloat = _LR
    betas: Betas = _BETAS
    eps: float = _EPS
    weight_decay: NonNegativeFloat = _WEIGHT_DECAY
    adam_w_mode: bool = Field(True, description="Decoupled weight decay (AdamW); false gives L2 decay.")
    adamw_mode: bool = Field(True, description="Spelling of adam_w_mode used by the CPUAdam constructor; "
                                               "give one of the two.")
    amsgrad: bool = Field(False, description="Accepted for compatibility; only false is supported.")
    bias_correction: bool = _BIAS_CORRECTION
    fp32_optimizer_states: bool = _FP32_STATES

    _bias = field_validator("bias_correction", "fp32_optimizer_states", mode="before")(_require_true)

    @model_validator(mode="after")
    def _supported_combinations(self) -> "CPUAdamParams":
        if self.amsgrad:
            raise rule_error("amsgrad=true is not supported by CPUAdam", ("amsgrad",))
        both = {"adam_w_mode", "adamw_mode"} <= self.model_fields_set
        if both and self.adam_w_mode != self.adamw_mode:
            raise rule_error("adam_w_mode and adamw_mode disagree; give only one of them", ("adamw_mode",))
        return self


def _eps_pair(value: Any) -> Any:
    # JSON has no tuples (and eps1 may be null: the parameter dtype's machine epsilon)
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"expected [eps1 or null, eps2], got {list(value)!r}")
        return tuple(value)
    return value


class AdafactorParams(ConfigModel):
    """``Adafactor``: torch.optim.Adafactor's parameters and update (factored second moments of each matrix), exact
    at every ZeRO stage and with optimizer offload (zeroengine/optim/adafactor.py)."""

    lr: NonNegativeFloat = Field(1e-2, description="Learning rate (the step is at most lr, and 1/sqrt(step)).")
    beta2_decay: float = Field(-0.8, le=0, description="The second moments' decay: beta2 at step t is 1 - t^beta2_decay.")
    eps: Annotated[Tuple[Optional[Annotated[float, Field(ge=0)]], Annotated[float, Field(ge=0)]],
                   BeforeValidator(_eps_pair)] = Field(
        (None, 1e-3), description="[eps1, eps2]: eps1 floors the second moment (null: the dtype's machine epsilon), "
                                  "eps2 the parameter's RMS in the step size.")
    d: float = Field(1.0, ge=1, description="Clipping threshold of the update's RMS.")
    weight_decay: NonNegativeFloat = _WEIGHT_DECAY
    maximize: bool = Field(False, description="Maximize the objective.")
    foreach: Optional[bool] = Field(None, description="Accepted for torch's signature; no effect.")


class SM3Params(ConfigModel):
    """``SM3``: Anil et al. 2019's SM3-II: one accumulator per row and per column of each matrix (per element for
    vectors), exact at every ZeRO stage and with optimizer offload (zeroengine/optim/sm3.py)."""

    lr: NonNegativeFloat = Field(0.1, description="Learning rate.")
    momentum: float = Field(0.0, ge=0, lt=1, description="Momentum on the preconditioned gradient, m = momentum * m + "
                                                         "(1 - momentum) * update (0: the paper's step, no buffer).")
    eps: NonNegativeFloat = Field(0.0, description="Added to sqrt(nu) in the denominator (0: the paper's 0/0 = 0).")


class MuonParams(ConfigModel):
    """``Muon``: DeepSpeed 0.19.8's MuonWithAuxAdam. Matrices whose names hold neither "embed" nor "lm_head" train
    with Muon (momentum orthogonalised by Newton-Schulz), the rest with Adam; exact at every ZeRO stage and with
    optimizer offload (zeroengine/optim/muon.py)."""

    lr: Optional[NonNegativeFloat] = Field(None, description="Learning rate of both halves (null: Muon 0.02, Adam "
                                                            "3e-4); muon_lr / adam_lr override it per half.")
    muon_lr: Optional[NonNegativeFloat] = Field(None, description="The Muon half's learning rate.")
    adam_lr: Optional[NonNegativeFloat] = Field(None, description="The Adam half's learning rate.")
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum (Nesterov).")
    weight_decay: NonNegativeFloat = _WEIGHT_DECAY
    ns_method: str = Field("gram", description="Newton-Schulz on the Gram matrix (\"gram\", fp16) or on the "
                                              "matrix (\"standard\", bf16); fp32 where the device cannot.")
    betas: Betas = Field((0.9, 0.95), description="The Adam half's betas.")
    eps: float = Field(1e-10, description="The Adam half's eps.")
    adam_w_mode: bool = Field(True, description="Decoupled weight decay in the Adam half.")
    per_head_muon: bool = Field(False, description="Orthogonalise each attention head of the q/k/v projections on "
                                                   "its own (head counts from the model's Hugging Face config, "
                                                   "confirmed by shape); an error when nothing can be tagged.")

    @field_validator("ns_method")
    @classmethod
    def _ns_method(cls, value: str) -> str:
        if value not in ("gram", "standard"):
            raise ValueError(f"ns_method must be 'gram' or 'standard', got {value!r}")
        return value


OPTIMIZER_PARAMS: Dict[str, Type[ConfigModel]] = {
    "Adam": AdamParams, "AdamW": AdamWParams, "SGD": SGDParams, "CPUAdam": CPUAdamParams,
    "Adafactor": AdafactorParams, "SM3": SM3Params, "Muon": MuonParams,
}


class OptimizerConfig(ConfigModel):
    """The optimizer zeroengine builds (leave the section out to pass your own to initialize())."""

    type: str = Field(description="One of Adam, AdamW, SGD, CPUAdam, Adafactor, SM3, Muon (any capitalisation).")
    params: Dict[str, Any] = Field(default_factory=dict,
                                   description="Arguments of the optimizer; the keys depend on type (see below).")

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value  # strict str validation reports the wrong type
        for name in OPTIMIZER_PARAMS:
            if value.lower() == name.lower():
                return name
        match = closest(value, OPTIMIZER_PARAMS)
        hint = f"did you mean '{match}'? " if match else ""
        raise ValueError(f"unknown optimizer type {value!r}; {hint}valid types: {', '.join(OPTIMIZER_PARAMS)} "
                         "(or pass your own torch optimizer to zeroengine.initialize)")

    @model_validator(mode="after")
    def _check_params(self) -> "OptimizerConfig":
        if "max_grad_norm" in self.params:
            raise rule_error("max_grad_norm is not an optimizer parameter; use the top-level "
                             "'gradient_clipping' key (as in DeepSpeed)", ("params", "max_grad_norm"))
        self.params = validate_given_keys(OPTIMIZER_PARAMS[self.type], self.params, ("optimizer", "params"))
        return self
