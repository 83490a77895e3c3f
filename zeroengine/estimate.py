"""``zeroengine.estimate_memory``: the model-state formulas of docs/concepts.md, before anything runs.

Per rank, Ψ parameters, N data-parallel ranks; with T-way tensor and P-stage pipeline parallelism a rank
holds Ψ/(T·P) of the model (the even split: replicated norms and biases are the small excess), which ZeRO
then divides by N (docs/parallelism.md). 16-bit training keeps 16-bit
parameters and gradients plus an fp32 master copy; fp32 training has no master
copy unless the optimizer is offloaded (the CPU steps fp32 masters then).

| stage | parameters | gradients | fp32 masters | optimizer state (Adam: 2 fp32) |
|---|---|---|---|---|
| 0 | full | full | full (16-bit only) | full |
| 1 | full | full | 1/N | 1/N |
| 2 | full | 1/N | 1/N | 1/N |
| 3 | 1/N | 1/N | 1/N | 1/N |
"""
from __future__ import annotations

import torch

_WIDTH = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def estimate_memory(model_or_param_count, world_size: int, stage: int, offload_optimizer: bool | float = False,
                    offload_param: bool = False, dtype: torch.dtype = torch.float32,
                    optimizer_state_bytes_per_param: int = 8, tensor_parallel_size: int = 1,
                    pipeline_parallel_size: int = 1, optimizer: str | None = None,
                    optimizer_params: dict | None = None, bf16_masters: bool = False,
                    bf16_optimizer_states: bool = False) -> dict[str, float]:
    """Predicted bytes of model states on one rank, by kind and by place ("device" / "cpu").

    ``offload_optimizer`` may be a fraction (``offload_optimizer.ratio``, partial offload): that share of
    the masters and optimizer state is in CPU memory, the rest on the device; in fp32 training only the
    offloaded share has masters (the resident share steps the parameters themselves). For a module,
    parameters count all its parameters and the rest only the trainable ones (frozen ones have no gradient,
    master or optimizer state); a count is taken as all trainable.

    ``optimizer`` (a config's ``optimizer.type``, with its ``optimizer_params``) replaces
    ``optimizer_state_bytes_per_param`` by that optimizer's state (zeroengine/optim/state_bytes.py): Adam 8 bytes
    per parameter, SGD 4 with momentum, Adafactor 4 × (rows + cols) per matrix and SM3 4 × the sum of its
    dimensions (4 per element for vectors; SM3's momentum adds 4 per parameter), Muon 4 per parameter of the
    matrices it steps and Adam's 8 for the rest. Those three need the module (their state depends on shapes and
    names). Sharded, the state divides by N; a matrix cut between ranks has its row and column
    statistics on each rank holding a piece, a few rows' worth more than 1/N.

    ``bf16_masters`` (``bf16.bf16_master_weights_and_grads``, bf16 only): no fp32 masters; the optimizer steps
    the bf16 parameters themselves, so masters cost nothing, except that the offloaded share is a bf16 copy in
    CPU memory (2 bytes per element, as fp32 training's offloaded share is a 4-byte one).
    ``bf16_optimizer_states`` (with ``bf16_masters``): Adam's moments in bf16, 4 bytes per parameter."""
    from zeroengine.optim.state_bytes import needs_shapes, state_bytes

    state_total = None
    if isinstance(model_or_param_count, torch.nn.Module):
        params = list(model_or_param_count.parameters())
        psi_all = sum(p.numel() for p in params)
        psi = sum(p.numel() for p in params if p.requires_grad)
        if optimizer is not None:
            from zeroengine.zero.param_guard import full_shape

            state_total = sum(state_bytes(optimizer, tuple(full_shape(p)), optimizer_params, name)
                              for name, p in model_or_param_count.named_parameters() if p.requires_grad)
    else:
        count = model_or_param_count
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not count >= 0 \
                or count != int(count):
            raise ValueError(f"model_or_param_count must be an nn.Module or a whole number of parameters >= 0, "
                             f"got {count!r}")
        psi = psi_all = int(count)
        if optimizer is not None:
            if needs_shapes(optimizer):
                raise ValueError(f"{optimizer}'s state depends on the parameters' shapes (and Muon's on their names): "
                                 "pass the module, not a count")
            state_total = state_bytes(optimizer, (psi,), optimizer_params)
    for name, size in (("tensor_parallel_size", tensor_parallel_size),
                       ("pipeline_parallel_size", pipeline_parallel_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    split = tensor_parallel_size * pipeline_parallel_size  # this rank's slice of the whole model
    psi, psi_all = psi / split, psi_all / split
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be the integer 0, 1, 2 or 3, got {stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(offload_optimizer, (bool, int, float)):
        raise ValueError(f"offload_optimizer must be a bool or a fraction within [0, 1], got {offload_optimizer!r}")
    ratio = float(offload_optimizer)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload_optimizer must be a bool or a fraction within [0, 1], got {offload_optimizer}")
    if ratio > 0 and stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
    if offload_param and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3")
    if dtype not in _WIDTH:
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    if bf16_masters and (dtype != torch.bfloat16 or stage == 0):
        raise ValueError("bf16_masters needs dtype=torch.bfloat16 and ZeRO stage 1, 2 or 3")
    if bf16_optimizer_states and (not bf16_masters or optimizer not in (None, "Adam", "AdamW")):
        raise ValueError("bf16_optimizer_states needs bf16_masters and Adam or AdamW (optimizer None, \"Adam\" or "
                         "\"AdamW\")")
    width, n = _WIDTH[dtype], world_size
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    stepped = psi / (n if sharded["optimizer"] else 1)  # elements this rank's optimizer steps
    if bf16_optimizer_states:
        optimizer_state_bytes_per_param, state_total = 4, None
    # Separate masters: fp32 ones in 16-bit training; otherwise only the offloaded share's host copy, in the
    # parameters' own dtype with bf16 masters (fp32 training: 4 bytes; bf16_masters: 2).
    master_width, master_share = (4, 1.0) if dtype != torch.float32 and not bf16_masters else (width, ratio)
    est = {
        "params": width * psi_all / (n if sharded["params"] else 1),
        "grads": width * psi / (n if sharded["grads"] else 1),
        "master_params": master_width * stepped * master_share,
        # (an optimizer's own formula: its whole state split evenly, over the model-parallel ranks too)
        "optimizer_states": (optimizer_state_bytes_per_param * stepped if state_total is None else
                             state_total / split / (n if sharded["optimizer"] else 1)),
    }
    on_cpu = ratio * (master_width * stepped + est["optimizer_states"]) + (est["params"] if offload_param else 0.0)
    total = sum(est.values())
    return {**est, "cpu": on_cpu, "device": total - on_cpu, "total": total}
