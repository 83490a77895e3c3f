"""``engine.save_16bit_model``: the live model, gathered, as one plain 16-bit (or fp32) state_dict file."""
from __future__ import annotations

import os

import torch

from zeroengine import comm
from zeroengine.progress import get_logger
from zeroengine.zero.gathered import GatheredParameters, is_partitioned

from .agreement import exchange
from .files import save_tensors


def gathered_state_dict(module: torch.nn.Module, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """The module's full state_dict on rank 0 (None elsewhere); stage-3 parameters are gathered
    one module at a time, so no rank ever holds more than one module's full parameters beyond the result.
    A tied parameter is one tensor under each of its names (as in ``state_dict()``), so savers that
    de-duplicate shared tensors (safetensors, Hugging Face) see the tie. ``exclude_frozen`` leaves out
    parameters that do not require grad."""
    from zeroengine.moe.params import expert_tag

    if any(tag is not None and tag.ep_size > 1 for tag in map(expert_tag, module.parameters())):
        # Each rank holds (at stage 3: gathers) only its own experts: rank 0 alone cannot write them all, as
        # DeepSpeed's AutoEP cannot either at ZeRO-3.
        raise NotImplementedError("the 16-bit weights of a model with expert parallelism (ep_size > 1) are not "
                                  "gathered on one rank; save with engine.save_checkpoint and consolidate with "
                                  "ze_to_fp32 (zeroengine.checkpoint.get_fp32_state_dict_from_zero_checkpoint), "
                                  "which stores every expert under its global place")
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    frozen: set[str] = set()
    rank0 = comm.get_rank() == 0
    for prefix, sub in module.named_modules(remove_duplicate=False):
        own = list(sub.parameters(recurse=False))
        with GatheredParameters(own):
            if rank0:
                for name, t in sub.named_parameters(recurse=False):
                    key = f"{prefix}.{name}" if prefix else name
                    if id(t) not in copies:
                        copies[id(t)] = t.detach().clone()
                    out[key] = copies[id(t)]
                    if not t.requires_grad:
                        frozen.add(key)
    if not rank0:
        return None
    # What is left are buffers.
    full = module.state_dict(keep_vars=True)  # keep_vars: names and order without touching partitioned params
    return {name: out[name] if name in out else value.detach().clone() for name, value in full.items()
            if not (exclude_frozen and name in frozen)}


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Collective (as in DeepSpeed): every rank calls it, rank 0 writes the file. A rank that does not
    arrive is named after the handshake deadline, instead of a collective timing out with no word on why.
    ``exclude_frozen_parameters`` leaves out parameters that do not require grad (adapters over a frozen base
    model: the file holds the adapters and the buffers)."""
    exchange("save_16bit_model", None, ". Call engine.save_16bit_model on all ranks, not under `if rank == 0:` "
                                       "(only rank 0 writes the file anyway)")
    engine.optimizer.land_delayed_update()  # (collective: after the exchange that names a missing rank)
    partitioned = any(is_partitioned(p) for p in engine.module.parameters())
    if partitioned and not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        if comm.get_rank() == 0:
            get_logger().warning(
                "save_16bit_model did not save the model: at ZeRO stage 3 it needs "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save=true (or consolidate a checkpoint "
                f"with ze_to_fp32 --dtype bf16{' --exclude_frozen_parameters' if exclude_frozen_parameters else ''})")
        return False
    state = gathered_state_dict(engine.module, exclude_frozen=exclude_frozen_parameters)
    if comm.get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        save_tensors(state, os.path.join(save_dir, save_filename))
    comm.barrier()
    return True
