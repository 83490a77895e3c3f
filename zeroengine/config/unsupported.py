"""DeepSpeed features zeroengine does not implement, and when their keys are harmless.

Why this list exists: real DeepSpeed configs carry blocks for features that
are switched off (``"flops_profiler": {"enabled": false}``,
``"zero_force_ds_cpu_optimizer": true``). Rejecting those as unknown
keys would make switching from DeepSpeed needlessly painful; accepting them
when they are *on* would silently train differently from what the user asked.
So each key is accepted exactly when its value means "feature off" (the
"neutral" value, DeepSpeed's default) and is otherwise an error that says the
feature is not implemented. Accepted keys are dropped before validation.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Tuple

from .errors import ConfigError, join_path


class Neutral(NamedTuple):
    """How a feature's key reads when the feature is off (null and {} always do)."""

    hint: str                    # completes "remove it or ..."
    accepted: str                # for the reference: the values accepted
    kind: str                    # "enabled": an object whose "enabled" is in `values`
                                 # "empty": an object whose values are all null/false
                                 # "value": exactly one of `values`
    values: Tuple[Any, ...] = ()

    def accepts(self, value: Any) -> bool:
        if value is None or value == {}:
            return True
        if self.kind == "enabled":
            return isinstance(value, dict) and _is_one_of(value.get("enabled", False), self.values)
        if self.kind == "empty":
            return isinstance(value, dict) and all(v is None or v is False for v in value.values())
        return _is_one_of(value, self.values)


def _is_one_of(value: Any, options: Tuple[Any, ...]) -> bool:
    # Booleans only match booleans: 0 is not "false" and 1 is not "true" here.
    return any(value is o if isinstance(o, bool) or isinstance(value, bool) else value == o for o in options)


ENABLED_FALSE = Neutral("set enabled=false", "`enabled: false`", "enabled", (False,))
EMPTY = Neutral("set its values to null", "every value null or false", "empty")


def off_value(value: Any) -> Neutral:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return Neutral(f"set it to {text}", f"`{text}`", "value", (value,))


class Unsupported(NamedTuple):
    key: str
    neutral: Neutral
    what: str  # what the feature does in DeepSpeed, for the reference


# Section path -> features found there. Neutral values are DeepSpeed's defaults.
UNSUPPORTED: Dict[str, Tuple[Unsupported, ...]] = {
    "": (
        # HuggingFace's integration writes "amp": {"enabled": "auto"}; outside its Trainer that means off.
        Unsupported("amp", Neutral("set enabled=false", "`enabled: false` or `enabled: \"auto\"`", "enabled",
                                   (False, "auto")), "NVIDIA Apex AMP"),
        Unsupported("aio", EMPTY, "async I/O for NVMe offload"),
        Unsupported("autotuning", ENABLED_FALSE, "automatic search of ZeRO/batch settings"),
        Unsupported("comet", ENABLED_FALSE, "Comet experiment logging"),
        Unsupported("comms_logger", ENABLED_FALSE, "logging of every collective"),
        Unsupported("compile", EMPTY, "torch.compile / DeepCompile integration"),
        Unsupported("compression_training", EMPTY, "quantization/pruning-aware training"),
        Unsupported("curriculum_learning", ENABLED_FALSE, "sequence-length curriculum"),
        Unsupported("data_efficiency", ENABLED_FALSE, "data sampling and routing library"),
        Unsupported("data_types", EMPTY, "separate gradient-accumulation dtype"),
        Unsupported("disable_allgather", off_value(False), "skipping the parameter all-gather"),
        Unsupported("dump_state", off_value(False), "printing the engine state at startup"),
        Unsupported("eigenvalue", ENABLED_FALSE, "Hessian eigenvalue computation"),
        Unsupported("elasticity", ENABLED_FALSE, "elastic batch sizes across world sizes"),
        Unsupported("flops_profiler", ENABLED_FALSE, "FLOPs profiler"),
        Unsupported("hybrid_engine", ENABLED_FALSE, "RLHF inference/training hybrid engine"),
        Unsupported("memory_breakdown", off_value(False), "memory-usage logging; zeroengine offers "
                    "engine.memory_breakdown() instead"),
        Unsupported("nebula", ENABLED_FALSE, "Azure Nebula checkpoint service"),
        Unsupported("pipeline", EMPTY, "pipeline parallelism"),
        Unsupported("progressive_layer_drop", ENABLED_FALSE, "progressive layer dropping"),
        Unsupported("quantize_training", ENABLED_FALSE, "MoQ quantize-aware training"),
        Unsupported("sparse_attention", EMPTY, "block-sparse attention kernels"),
        Unsupported("sparse_gradients", off_value(False), "sparse embedding gradients"),
        Unsupported("torch_autocast", ENABLED_FALSE, "torch.autocast-based mixed precision"),
        Unsupported("wandb", ENABLED_FALSE, "Weights & Biases logging"),
        Unsupported("zero_force_ds_cpu_optimizer", off_value(True), "requiring DeepSpeed's CPU optimizer "
                    "with offload"),
    ),
    "zero_optimization": (
        Unsupported("legacy_stage1", off_value(False), "the pre-0.4 stage-1 implementation"),
        Unsupported("zero_hpz_partition_size", off_value(1), "ZeRO++ hierarchical partitioning"),
        Unsupported("zero_quantized_weights", off_value(False), "ZeRO++ quantized weight all-gather"),
        Unsupported("zero_quantized_nontrainable_weights", off_value(False),
                    "ZeRO++ quantized frozen weights"),
        Unsupported("zero_quantized_gradients", off_value(False), "ZeRO++ quantized gradient reduction"),
        Unsupported("mics_shard_size", off_value(-1), "MiCS sub-group sharding"),
        Unsupported("mics_hierarchical_params_gather", off_value(False), "MiCS hierarchical all-gather"),
        Unsupported("zenflow", EMPTY, "ZenFlow stall-free offload"),
    ),
    "zero_optimization.offload_optimizer": (
        Unsupported("nvme_path", off_value(None), "NVMe offload, i.e. ZeRO-Infinity"),
        Unsupported("buffer_count", off_value(4), "NVMe offload buffers"),
        Unsupported("pipeline_read", off_value(False), "NVMe offload read pipelining"),
        Unsupported("pipeline_write", off_value(False), "NVMe offload write pipelining"),
        Unsupported("fast_init", off_value(False), "NVMe offload fast initialization"),
        Unsupported("ratio", off_value(1.0), "partial optimizer offload"),
        Unsupported("super_offload", off_value(False), "SuperOffload for Superchips"),
    ),
    "zero_optimization.offload_param": (
        Unsupported("nvme_path", off_value(None), "NVMe offload, i.e. ZeRO-Infinity"),
        Unsupported("buffer_count", off_value(5), "NVMe offload buffers"),
        Unsupported("buffer_size", off_value(100_000_000), "NVMe offload buffers"),
        Unsupported("max_in_cpu", off_value(1_000_000_000), "NVMe offload CPU cache"),
    ),
    "fp16": (
        Unsupported("fp16_master_weights_and_grads", off_value(False), "fp16 master weights"),
    ),
    "checkpoint": (
        Unsupported("parallel_write", EMPTY, "pipeline-stage parallel checkpoint writes"),
        Unsupported("writer", off_value(None), "DeepSpeed's fast checkpoint writer"),
        Unsupported("checkpoint_serialization", off_value(True), "legacy torch.save serialization switch"),
    ),
}


def unsupported_keys_at(section: str) -> List[str]:
    """Unimplemented-feature keys accepted (when neutral) under ``section``."""
    return [entry.key for entry in UNSUPPORTED.get(section, ())]


def drop_unsupported_features(data: Dict[str, Any]) -> None:
    """Remove neutral unimplemented-feature keys from ``data``; raise for any that is switched on."""
    for section, entries in UNSUPPORTED.items():
        block = _find(data, section)
        if not isinstance(block, dict):
            continue
        for entry in entries:
            if entry.key not in block:
                continue
            if not entry.neutral.accepts(block[entry.key]):
                raise ConfigError(join_path(section, entry.key),
                                  f"'{entry.key}' is a DeepSpeed feature zeroengine does not implement "
                                  f"({entry.what}); remove it or {entry.neutral.hint}")
            del block[entry.key]


def _find(data: Dict[str, Any], section: str) -> Any:
    block: Any = data
    for part in section.split(".") if section else ():
        if not isinstance(block, dict):
            return None
        block = block.get(part)
    return block
