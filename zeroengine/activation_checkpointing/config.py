"""``configure``: the process-wide activation-checkpointing settings.

DeepSpeed keeps these as module globals set by ``checkpointing.configure``,
and model code (Megatron and its descendants) calls ``checkpoint`` without
passing any options, so the settings must be process-wide here too. They are
held as one frozen :class:`Settings` value, replaced as a whole by
``configure`` / ``reset``, never mutated piecemeal.

Argument spellings: DeepSpeed's ``configure`` names differ from its config
keys (``checkpoint_in_cpu`` vs ``cpu_checkpointing``, ``contiguous_checkpointing``
vs ``contiguous_memory_optimization``, ``num_checkpoints`` vs
``number_checkpoints``, ``synchronize`` vs ``synchronize_checkpoint_boundary``);
both are accepted so migrated scripts run unchanged. As in DeepSpeed, values
from ``deepspeed_config`` come first and explicit arguments override them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from zeroengine.config import ConfigError, ZeroEngineConfig, read_config_file
from zeroengine.config.sections.activation_checkpointing import ActivationCheckpointingConfig
from zeroengine.config.translate import validate

logger = logging.getLogger("zeroengine.checkpointing")

_SECTION = "activation_checkpointing"


@dataclass(frozen=True)
class Settings:
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    # The model-parallel group saved inputs are split across (None: no model parallelism).
    mp_group: Any = None
    mp_world_size: int = 1
    mp_rank: int = 0
    configured: bool = False
    by_initialize: bool = False  # set from a config by initialize(), not by the script's own configure()

    @property
    def partitions(self) -> int:
        """How many pieces each saved input is cut into (1 when partitioning has nothing to split across)."""
        return self.mp_world_size if self.partition_activations else 1


_SETTINGS = Settings()


def current() -> Settings:
    return _SETTINGS


def is_configured() -> bool:
    """True once ``configure`` (or ``initialize`` with an activation_checkpointing section) has run."""
    return _SETTINGS.configured


def reset() -> None:
    """Back to the defaults (plain recompute, nothing partitioned or offloaded); frees the contiguous buffers."""
    global _SETTINGS
    _SETTINGS = Settings()
    from .storage import release_arenas

    release_arenas()


def _section_from(deepspeed_config) -> ActivationCheckpointingConfig:
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, ZeroEngineConfig):
        return deepspeed_config.activation_checkpointing
    if isinstance(deepspeed_config, (str, os.PathLike)):
        deepspeed_config = read_config_file(deepspeed_config)
    if not isinstance(deepspeed_config, dict):
        raise ConfigError("", "deepspeed_config must be a path, a dict or a config object, "
                              f"got {type(deepspeed_config).__name__}")
    return validate(ActivationCheckpointingConfig, deepspeed_config.get(_SECTION, {}), prefix=(_SECTION,))


def _pick(name: str, alias: str, value, alias_value):
    if value is not None and alias_value is not None and bool(value) != bool(alias_value):
        raise ValueError(f"configure(): {name}={value!r} and {alias}={alias_value!r} disagree; pass one of them")
    return value if value is not None else alias_value


def _model_parallel(mpu) -> tuple[Any, int, int]:
    """(group, world size, rank) from a Megatron-style mpu object; older and newer method names both work."""
    if mpu is None:
        return None, 1, 0
    for prefix in ("get_model_parallel_", "get_tensor_model_parallel_"):
        if hasattr(mpu, prefix + "group"):
            return (getattr(mpu, prefix + "group")(), int(getattr(mpu, prefix + "world_size")()),
                    int(getattr(mpu, prefix + "rank")()))
    raise TypeError("mpu must provide get_model_parallel_group/_world_size/_rank "
                    "(or the get_tensor_model_parallel_* spellings)")


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None, *,
              cpu_checkpointing=None, contiguous_memory_optimization=None, number_checkpoints=None,
              synchronize_checkpoint_boundary=None) -> Settings:
    """Set how ``checkpoint`` stores the inputs it saves (DeepSpeed's signature; both spellings accepted).

    ``mpu_``: an object with ``get_model_parallel_group/world_size/rank``; with
    ``partition_activations`` each of its ranks keeps 1/N of every saved input.
    Unspecified options come from ``deepspeed_config``'s activation_checkpointing
    section (a path, dict or parsed config), else their defaults.
    """
    global _SETTINGS
    section = _section_from(deepspeed_config) if deepspeed_config is not None else ActivationCheckpointingConfig()
    values = section.model_dump()
    explicit = {
        "partition_activations": partition_activations,
        "cpu_checkpointing": _pick("cpu_checkpointing", "checkpoint_in_cpu", cpu_checkpointing, checkpoint_in_cpu),
        "contiguous_memory_optimization": _pick("contiguous_memory_optimization", "contiguous_checkpointing",
                                                contiguous_memory_optimization, contiguous_checkpointing),
        "synchronize_checkpoint_boundary": _pick("synchronize_checkpoint_boundary", "synchronize",
                                                 synchronize_checkpoint_boundary, synchronize),
        "profile": profile,
    }
    values.update({k: bool(v) for k, v in explicit.items() if v is not None})
    if number_checkpoints is not None and num_checkpoints is not None and number_checkpoints != num_checkpoints:
        raise ValueError(f"configure(): number_checkpoints={number_checkpoints} and "
                         f"num_checkpoints={num_checkpoints} disagree; pass one of them")
    if (number_checkpoints or num_checkpoints) is not None:
        values["number_checkpoints"] = number_checkpoints or num_checkpoints
    # The same rules as the config section (and DeepSpeed's configure), with the same key paths.
    validate(ActivationCheckpointingConfig, values, prefix=(_SECTION,))
    group, world, rank = _model_parallel(mpu_)
    if values["partition_activations"] and world == 1:
        logger.warning("activation_checkpointing.partition_activations: no model-parallel group of more than one "
                       "rank (pass mpu to initialize/configure), so saved inputs are kept whole; it has no effect")
    _SETTINGS = Settings(**values, mp_group=group, mp_world_size=world, mp_rank=rank, configured=True)
    from .storage import release_arenas

    release_arenas()
    return _SETTINGS


def configure_from_initialize(cfg: ZeroEngineConfig, mpu) -> None:
    """What ``zeroengine.initialize`` does: configure from the config's section when it has one (or an mpu is given).

    A script that called ``configure`` itself and has no activation_checkpointing
    section keeps its settings, as with DeepSpeed (whose Megatron users call
    ``deepspeed.checkpointing.configure`` directly).
    """
    global _SETTINGS
    if _SECTION not in cfg.model_fields_set and mpu is None:
        return
    if mpu is None and is_configured() and not _SETTINGS.by_initialize:
        # The script called configure(mpu, ...) itself (Megatron's order, which passes no mpu to initialize):
        # its group and options stand, as in DeepSpeed, whose initialize never reconfigures checkpointing.
        logger.info("activation_checkpointing: keeping the script's own checkpointing.configure() settings")
        return
    if _SECTION not in cfg.model_fields_set and is_configured():
        # Keep the script's own options; only the model-parallel group is new.
        keep = {k: getattr(_SETTINGS, k) for k in ActivationCheckpointingConfig.model_fields}
        configure(mpu, **keep)
    else:
        configure(mpu, deepspeed_config=cfg.activation_checkpointing)
    _SETTINGS = dataclasses.replace(_SETTINGS, by_initialize=True)
