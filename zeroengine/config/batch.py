"""The batch-size triangle: train_batch_size = micro_batch * accumulation_steps * world_size.

DeepSpeed lets a config give any two of the three and derives the third, and
derives the rest from train_batch_size or the micro batch alone (with one
accumulation step). A value that does not divide evenly is an error, never
rounded: rounding would silently train with a different batch than asked.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def take_auto_batch_keys(data: Dict[str, Any]) -> bool:
    """Remove batch keys set to "auto" (they are derived instead); return whether there were any."""
    auto = [key for key in BATCH_KEYS if data.get(key) == "auto" and isinstance(data[key], str)]
    for key in auto:
        del data[key]
    return bool(auto)


def resolve_batch(train_batch_size: Optional[int], micro_batch: Optional[int], accumulation: Optional[int],
                  world_size: int, *, any_auto: bool = False) -> Tuple[int, int, int]:
    """(train_batch_size, micro batch per rank, accumulation steps) from those given (None = not given).

    ``any_auto``: some of the keys were "auto". Then, when too few are given to
    derive the rest, the micro batch and accumulation steps default to 1 rather
    than being an error, as HuggingFace's integration would fill them.
    """
    tbs, micro, gas, world = train_batch_size, micro_batch, accumulation, world_size
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            raise ConfigError("train_batch_size",
                              f"train_batch_size ({tbs}) != train_micro_batch_size_per_gpu ({micro}) * "
                              f"gradient_accumulation_steps ({gas}) * world size ({world}) = "
                              f"{micro * gas * world}; fix one of them or leave one out to have it derived")
        return tbs, micro, gas
    if tbs is not None and micro is not None:
        return tbs, micro, _divide(tbs, micro * world, "gradient_accumulation_steps",
                                   f"train_micro_batch_size_per_gpu ({micro}) * world size ({world})")
    if tbs is not None and gas is not None:
        return tbs, _divide(tbs, gas * world, "train_micro_batch_size_per_gpu",
                            f"gradient_accumulation_steps ({gas}) * world size ({world})"), gas
    if micro is not None:
        gas = gas if gas is not None else 1
        return micro * gas * world, micro, gas
    if tbs is not None:
        return tbs, _divide(tbs, world, "train_micro_batch_size_per_gpu", f"the world size ({world})"), 1
    if any_auto:
        gas = gas if gas is not None else 1
        return gas * world, 1, gas
    alone = " (gradient_accumulation_steps alone does not determine it)" if gas is not None else ""
    raise ConfigError("train_batch_size", f"no batch size given{alone}: set train_batch_size or "
                                          "train_micro_batch_size_per_gpu")


def _divide(tbs: int, divisor: int, derived: str, divisor_text: str) -> int:
    if tbs % divisor:
        raise ConfigError("train_batch_size",
                          f"train_batch_size ({tbs}) is not divisible by {divisor_text} = {divisor}, "
                          f"so {derived} cannot be derived")
    return tbs // divisor
