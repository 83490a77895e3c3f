"""Sharded checkpoints that load into any world size and ZeRO stage, written crash-safely.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` call :func:`save_checkpoint`
and :func:`load_checkpoint`; ``ze_to_fp32`` and the ``*_from_zero_checkpoint``
functions consolidate a checkpoint without a process group.
"""
from .consolidate import (
    convert_zero_checkpoint_to_16bit_state_dict,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from .files import CheckpointError
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = [
    "CheckpointError", "convert_zero_checkpoint_to_16bit_state_dict", "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint", "load_checkpoint", "load_state_dict_from_zero_checkpoint",
    "save_checkpoint",
]
