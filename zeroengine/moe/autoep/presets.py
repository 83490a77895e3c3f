"""Where the MoE blocks of known model families are, and how many experts they have.

Every family transformers 5.x ships with fused experts has the same block
shape: ``model.layers.<i>.mlp`` holding a router ``gate`` (weight ``[E, H]``)
and the experts ``experts`` (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``); dense layers (DeepSeek's first ``first_k_dense_replace``,
Qwen-MoE's ``mlp_only_layers``) have an ``mlp`` without ``experts`` and are
left alone. What differs between families is routing, which AutoEP leaves
to the model's own router, and the config attribute naming the expert count.
Preset names are DeepSpeed's (``qwen3_moe`` covers Qwen2-MoE there too);
``olmoe`` is one DeepSpeed does not have.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LAYER_PATTERN = r"model\.layers\.\d+\.mlp"


@dataclass(frozen=True)
class Preset:
    name: str
    model_types: tuple[str, ...]  # transformers' config.model_type values it covers
    num_experts_attr: str
    layer_pattern: str = DEFAULT_LAYER_PATTERN
    router: str = "gate"
    experts: str = "experts"


PRESETS = {p.name: p for p in (
    Preset("mixtral", ("mixtral",), "num_local_experts"),
    Preset("qwen3_moe", ("qwen3_moe", "qwen2_moe"), "num_experts"),
    Preset("deepseek_v2", ("deepseek_v2",), "n_routed_experts"),
    Preset("deepseek_v3", ("deepseek_v3",), "n_routed_experts"),
    Preset("olmoe", ("olmoe",), "num_experts"),
)}
ALIASES = {"qwen2_moe": "qwen3_moe"}


def preset_for(name: str | None, model_type: str | None) -> Preset:
    """The preset named ``name``, else the one covering ``model_type`` (transformers' ``config.model_type``)."""
    if name is not None:
        preset = PRESETS.get(ALIASES.get(name, name))
        if preset is None:
            raise ValueError(f"expert_parallel.preset_model: unknown preset {name!r}; known: "
                             f"{sorted(PRESETS) + sorted(ALIASES)} (or give moe_layer_pattern for another model)")
        return preset
    for preset in PRESETS.values():
        if model_type in preset.model_types:
            return preset
    known = sorted(t for p in PRESETS.values() for t in p.model_types)
    raise ValueError(f"expert_parallel: no preset for this model (config.model_type {model_type!r}; presets cover "
                     f"{known}); set expert_parallel.preset_model, or moe_layer_pattern (with router_pattern, "
                     "expert_pattern and num_experts_attr) for another model with the same block layout")
