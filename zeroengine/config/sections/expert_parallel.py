"""``expert_parallel``: AutoEP, expert parallelism for the MoE blocks of Hugging Face models (DeepSpeed's keys).

zeroengine's AutoEP (zeroengine/moe/autoep) replaces only each block's experts
module and keeps the model's own router, so the keys DeepSpeed uses to rebuild
a router (score function, normalisation, scaling, grouping, top-k) must be left
at their defaults, which mean "as the model does"; setting one is an error
rather than a silently different routing. DeepSpeed's kernel and communication
tuning keys are accepted and have no effect (listed in ``TUNING_KEYS``).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, model_validator

from ..base import ConfigModel, PositiveInt, rule_error

# DeepSpeed's implementation choices for its own kernels and DeepEP; nothing here to choose between.
TUNING_KEYS = ("disable_triton_grouped_mm", "gate_up_impl", "combine_impl", "row_weighting_impl", "comm_num_sm",
               "comm_qp_margin", "comm_max_tokens_per_rank", "async_split_plan", "validate_folding_routing")

_ROUTER_KEPT = "zeroengine keeps the model's own router, which decides this itself"
# key -> (the value that means "as the model does", why another one is refused)
_MUST_STAY = {
    "score_func": ("auto", _ROUTER_KEPT),
    "route_norm": (None, _ROUTER_KEPT),
    "route_scale": (1.0, _ROUTER_KEPT),
    "routed_scaling_factor": ("auto", _ROUTER_KEPT),
    "top_k": ("auto", _ROUTER_KEPT),
    "num_expert_groups": (None, _ROUTER_KEPT),
    "num_limited_groups": (None, _ROUTER_KEPT),
    "load_balance_coeff": (None, "the auxiliary-loss-free expert bias update is not implemented; the model's "
                                 "own load-balancing loss (router_aux_loss_coef) applies"),
    "expert_activation": (None, "the experts run the model's own activation (its experts' act_fn)"),
    "expert_tensor_parallel_size": (1, "experts are not split across tensor-parallel ranks"),
    "comm_backend": ("comm", "tokens travel by all-to-all over torch.distributed (DeepEP is not used)"),
}


class ExpertParallelConfig(ConfigModel):
    """AutoEP: find the MoE blocks of a Hugging Face model (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE) and
    spread their experts over expert-parallel groups of ``autoep_size`` ranks."""

    enabled: bool = Field(False, description="Convert the model's MoE blocks at initialize.")
    autoep_size: PositiveInt = Field(1, description="Ranks each block's experts are spread over (it must divide "
                                                    "the world size and the number of experts); the other "
                                                    "dimension is expert data parallelism.")
    preset_model: Optional[str] = Field(
        None, description="mixtral, qwen3_moe (also qwen2_moe), deepseek_v2, deepseek_v3 or olmoe; null: from the "
                          "model's config.model_type.")
    moe_layer_pattern: Optional[str] = Field(
        None, description="Regular expression (full match) for the MoE blocks' module names, for a model no preset "
                          "covers or to restrict a preset; default: the preset's (model.layers.<i>.mlp).")
    router_pattern: Optional[str] = Field(None, description="Name of the block's router child (default 'gate').")
    expert_pattern: Optional[str] = Field(None, description="Name of the block's experts child (default 'experts').")
    num_experts_attr: Optional[str] = Field(
        None, description="model.config attribute holding the number of experts (default: the preset's); the "
                          "router's weight is checked against it.")
    top_k_attr: Optional[str] = Field(None, description="Accepted: the model's router takes its own top-k.")
    expert_w1: Optional[str] = Field(None, description="The experts' fused gate+up weight: 'gate_up_proj' (the "
                                                      "only layout supported) or null.")
    expert_w2: Optional[str] = Field(None, description="The experts' down weight: 'down_proj' or null.")
    expert_w3: Optional[str] = Field(None, description="Only null: a separate up weight is not supported.")
    has_shared_experts: Optional[bool] = Field(None, description="Accepted: shared experts stay in the block and "
                                                                 "run as the model runs them (dense, replicated).")
    shared_experts_pattern: Optional[str] = Field(None, description="Accepted (see has_shared_experts).")
    shared_experts_gate_pattern: Optional[str] = Field(None, description="Accepted (see has_shared_experts).")
    use_grouped_mm: bool = Field(True, description="Run the local experts as torch._grouped_mm GEMMs where it "
                                                   "runs (CUDA); false: one GEMM pair per expert.")
    score_apply: Literal["auto", "post"] = Field(
        "auto", description="Where the router weight applies: after the expert (what every supported model does).")
    score_func: str = Field("auto", description="Only 'auto': " + _ROUTER_KEPT + ".")
    route_norm: Optional[bool] = Field(None, description="Only null: " + _ROUTER_KEPT + ".")
    route_scale: float = Field(1.0, description="Only 1.0: " + _ROUTER_KEPT + ".")
    routed_scaling_factor: Union[float, str] = Field("auto", description="Only 'auto': " + _ROUTER_KEPT + ".")
    top_k: Union[int, str] = Field("auto", description="Only 'auto': " + _ROUTER_KEPT + ".")
    num_expert_groups: Optional[int] = Field(None, description="Only null: " + _ROUTER_KEPT + ".")
    num_limited_groups: Optional[int] = Field(None, description="Only null: " + _ROUTER_KEPT + ".")
    load_balance_coeff: Optional[float] = Field(None, description="Only null: " + _MUST_STAY["load_balance_coeff"][1]
                                                + ".")
    expert_activation: Optional[str] = Field(None, description="Only null: " + _MUST_STAY["expert_activation"][1]
                                             + ".")
    expert_tensor_parallel_size: PositiveInt = Field(1, description="Only 1: experts are not tensor-parallel.")
    comm_backend: str = Field("comm", description="Only 'comm': " + _MUST_STAY["comm_backend"][1] + ".")

    @model_validator(mode="before")
    @classmethod
    def _drop_tuning_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k not in TUNING_KEYS}

    @model_validator(mode="after")
    def _router_is_the_models(self) -> "ExpertParallelConfig":
        for key, (default, why) in _MUST_STAY.items():
            if getattr(self, key) != default:
                raise rule_error(f"{key}={getattr(self, key)!r} is not supported: {why}; remove the key "
                                 f"(or set {default!r})", (key,))
        for key, name in (("expert_w1", "gate_up_proj"), ("expert_w2", "down_proj")):
            if getattr(self, key) not in (None, name):
                raise rule_error(f"{key}={getattr(self, key)!r}: AutoEP converts fused experts whose weights are "
                                 f"gate_up_proj [E, 2I, H] and down_proj [E, H, I] (transformers 5's layout)", (key,))
        if self.expert_w3 is not None:
            raise rule_error("expert_w3: separate up-projection weights are not supported (AutoEP converts fused "
                             "gate_up_proj experts); remove the key", ("expert_w3",))
        return self
