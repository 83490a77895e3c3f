"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (also ``deepspeed.checkpointing``):
zeroengine's activation checkpointing (:mod:`zeroengine.checkpointing`, the same functions and settings) with
DeepSpeed's meaning where the two differ.

* ``reset()`` frees the contiguous-checkpoint buffers and keeps the settings, as DeepSpeed's (Megatron calls it
  after each evaluation pass); zeroengine's own ``zeroengine.checkpointing.reset`` also forgets the settings.
* ``set_num_layers(n)`` and ``partition_activations_in_checkpoint(flag)`` change one setting of a configured
  process and keep the others.
* DeepSpeed's module globals a script may read (``PARTITION_ACTIVATIONS``, ``CPU_CHECKPOINT``,
  ``CONTIGUOUS_CHECKPOINTING``, ``SYNCHRONIZE``, ``PROFILE_TIME``, ``num_layers``, ``mp_rank``, ``mp_size``,
  ``mp_group``) answer from the current settings; assigning them changes nothing (call ``configure``).
"""
from __future__ import annotations

import dataclasses

from zeroengine.activation_checkpointing.storage import release_arenas
from zeroengine.checkpointing import (  # noqa: F401
    CheckpointFunction,
    RNGStatesTracker,
    checkpoint,
    configure,
    current,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
)

CudaRNGStatesTracker = RNGStatesTracker  # DeepSpeed's class name (it tracks CPU generators too here)

# DeepSpeed's non-reentrant variant: zeroengine's checkpoint already saves no more than the segment's inputs
# and handles inputs that need no gradient, so both names are the same function.
non_reentrant_checkpoint = checkpoint


def reset() -> None:
    """Free the buffers of contiguous checkpointing (after forward passes without backward, e.g. evaluation);
    the settings stay as configured."""
    release_arenas()


def set_num_layers(nlayers: int) -> None:
    """The number of checkpoints per forward pass (contiguous checkpointing sizes its buffer from it). Before
    ``configure`` it has no effect, as in DeepSpeed (whose ``configure`` resets it)."""
    if is_configured():
        _reconfigure(number_checkpoints=nlayers)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn the partitioning of saved inputs across the model-parallel ranks on or off."""
    _reconfigure(partition_activations=bool(partition_activation))


def _reconfigure(**changes) -> None:
    settings = current()
    options = {key: getattr(settings, key) for key in ("partition_activations", "cpu_checkpointing",
                                                       "contiguous_memory_optimization", "number_checkpoints",
                                                       "synchronize_checkpoint_boundary", "profile")}
    options.update(changes)
    configure(_SettingsGroup(settings) if settings.mp_world_size > 1 else None, **options)


@dataclasses.dataclass(frozen=True)
class _SettingsGroup:
    """The model-parallel group of the current settings, as the mpu ``configure`` takes."""

    settings: object

    def get_model_parallel_group(self):
        return self.settings.mp_group

    def get_model_parallel_world_size(self):
        return self.settings.mp_world_size

    def get_model_parallel_rank(self):
        return self.settings.mp_rank


_GLOBALS = {
    "PARTITION_ACTIVATIONS": lambda s: s.partition_activations,
    "CPU_CHECKPOINT": lambda s: s.cpu_checkpointing,
    "CONTIGUOUS_CHECKPOINTING": lambda s: s.contiguous_memory_optimization,
    "SYNCHRONIZE": lambda s: s.synchronize_checkpoint_boundary,
    "PROFILE_TIME": lambda s: s.profile,
    "num_layers": lambda s: s.number_checkpoints,
    "mp_rank": lambda s: s.mp_rank,
    "mp_size": lambda s: s.mp_world_size,
    "mp_group": lambda s: s.mp_group,
    "deepspeed_checkpointing_enabled": lambda s: s.configured,
}


def __getattr__(name: str):
    if name in _GLOBALS:
        return _GLOBALS[name](current())
    raise AttributeError(f"module 'deepspeed.checkpointing' (zeroengine's) has no attribute {name!r}")
