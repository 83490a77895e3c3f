"""Activation checkpointing: keep segment inputs, recompute activations in backward.

    from zeroengine import checkpointing
    checkpointing.configure(mpu, partition_activations=True, checkpoint_in_cpu=True)
    y = checkpointing.checkpoint(block, x, mask)          # or:
    checkpointing.checkpoint_modules(model, TransformerBlock)

``zeroengine.initialize(..., mpu=mpu)`` calls ``configure`` from the config's
``activation_checkpointing`` section. See docs/activation-checkpointing.md.
"""
from .checkpoint import CheckpointFunction, checkpoint, is_recomputing
from .compressed import (
    BitMaskReLU,
    CompressionStats,
    compress_saved_activations,
    relu_with_bit_mask,
    use_bit_mask_relu,
)
from .config import Settings, configure, current, is_configured, reset
from .offload_hidden import CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager
from .profile import format_profile, profile_report, reset_profile
from .rng_tracker import (
    RNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
)
from .wrap import checkpoint_modules, uncheckpoint_modules

__all__ = [
    "BitMaskReLU", "CheckpointFunction", "CheckpointHiddenStatesOffload", "CompressionStats", "RNGStatesTracker",
    "Settings", "checkpoint", "checkpoint_modules", "compress_saved_activations", "configure", "current",
    "format_profile",
    "get_checkpoint_hidden_states_offloading_ctx_manager", "get_cuda_rng_tracker", "is_configured",
    "is_recomputing", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "profile_report",
    "relu_with_bit_mask", "reset", "reset_profile", "uncheckpoint_modules", "use_bit_mask_relu",
]
