"""Find a model's MoE blocks and give each an expert-parallel experts module (``expert_parallel`` config).

Called by ``initialize()`` after every rank holds rank 0's weights and before
the optimizer is resolved, so each rank keeps exactly its experts of the same
values, and ZeRO sees the converted parameters (tagged as expert parameters:
reduced and partitioned within their expert-data-parallel group, as those of
:class:`zeroengine.moe.MoE`). Collective: every rank converts the same blocks in
the same order (the expert groups are created on first use).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

from zeroengine import comm

from .experts import FUSED_NAMES, ShardedExperts
from .presets import DEFAULT_LAYER_PATTERN, preset_for


@dataclass(frozen=True)
class Conversion:
    """What AutoEP did: the converted blocks (module names), experts per block, the expert-parallel size."""

    blocks: tuple[str, ...]
    num_experts: int
    ep_size: int
    preset: str | None


def convert_moe_blocks(model: nn.Module, ep) -> Conversion:
    """Replace the experts of every MoE block of ``model`` (see the module doc); returns what was converted.
    ``ep``: the config's ``expert_parallel`` section (``zeroengine.config.sections.expert_parallel``)."""
    world = comm.get_world_size()
    if world % ep.autoep_size:
        raise ValueError(f"expert_parallel.autoep_size ({ep.autoep_size}) must divide the world size ({world})")
    config = getattr(model, "config", None)
    custom = ep.moe_layer_pattern is not None and ep.preset_model is None
    preset = None if custom else preset_for(ep.preset_model, getattr(config, "model_type", None))
    pattern = re.compile(ep.moe_layer_pattern or (preset.layer_pattern if preset else DEFAULT_LAYER_PATTERN))
    router_name = ep.router_pattern or (preset.router if preset else "gate")
    experts_name = ep.expert_pattern or (preset.experts if preset else "experts")
    experts_attr = ep.num_experts_attr or (preset.num_experts_attr if preset else None)
    expected = _config_experts(config, experts_attr)
    blocks, num_experts = [], None
    for name, block in list(model.named_modules()):
        if not pattern.fullmatch(name) or not isinstance(getattr(block, experts_name, None), nn.Module):
            continue  # not a block, or a dense layer of an MoE model (an mlp with no experts)
        experts = getattr(block, experts_name)
        if isinstance(experts, ShardedExperts):
            raise ValueError(f"expert_parallel: {name}.{experts_name} is already expert-parallel (converted by an "
                             "earlier initialize); build the model again")
        count = _check_block(name, block, router_name, experts_name, expected)
        if count % ep.autoep_size:
            raise ValueError(f"expert_parallel.autoep_size ({ep.autoep_size}) must divide the number of experts "
                             f"({count}) of {name}; divisors that also divide the world size ({world}): "
                             f"{[d for d in range(1, count + 1) if count % d == 0 and world % d == 0]}")
        setattr(block, experts_name, ShardedExperts(experts, ep.autoep_size, grouped_mm=ep.use_grouped_mm))
        blocks.append(name)
        num_experts = count
    if not blocks:
        raise ValueError(f"expert_parallel: no MoE block found (modules matching {pattern.pattern!r} with a "
                         f"{experts_name!r} child holding {' and '.join(FUSED_NAMES)}); check preset_model or "
                         "moe_layer_pattern / expert_pattern")
    return Conversion(tuple(blocks), num_experts, ep.autoep_size, preset.name if preset else None)


def _config_experts(config, attr: str | None) -> int | None:
    if attr is None or config is None:
        return None
    value = getattr(config, attr, None)
    if value is None:
        raise ValueError(f"expert_parallel: the model's config has no {attr!r} (the number of experts); set "
                         "expert_parallel.num_experts_attr")
    return int(value)


def _check_block(name: str, block: nn.Module, router_name: str, experts_name: str, expected: int | None) -> int:
    """The block's number of experts, after checking its layout is the one :class:`ShardedExperts` runs."""
    experts = getattr(block, experts_name)
    params = dict(experts.named_parameters(recurse=False))
    where = f"expert_parallel: {name}.{experts_name} ({type(experts).__name__})"
    act = getattr(experts, "act_fn", None)
    if set(params) != set(FUSED_NAMES) or act is None or list(experts.children()) not in ([], [act]):
        raise ValueError(f"{where} holds {sorted(params)}; AutoEP converts fused experts holding exactly "
                         f"{list(FUSED_NAMES)} (transformers 5's layout) and an act_fn")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"{where}: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    count, two_inter, hidden = gate_up.shape
    if tuple(down.shape) != (count, hidden, two_inter // 2):
        raise ValueError(f"{where}: down_proj is {tuple(down.shape)}, expected {(count, hidden, two_inter // 2)} "
                         f"for gate_up_proj {tuple(gate_up.shape)} (a transposed layout is not supported)")
    router = getattr(block, router_name, None)
    weight = getattr(router, "weight", None)
    if weight is None or tuple(weight.shape) != (count, hidden):
        raise ValueError(f"expert_parallel: {name}.{router_name} should be the router with a weight of shape "
                         f"{(count, hidden)}, got {None if weight is None else tuple(weight.shape)}; set "
                         "expert_parallel.router_pattern")
    if expected is not None and expected != count:
        raise ValueError(f"expert_parallel: {name} has {count} experts but the model's config says {expected}")
    return count
