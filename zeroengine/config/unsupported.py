"""DeepSpeed features zeroengine does not implement, and when their keys are harmless.

Why this list exists: real DeepSpeed configs carry blocks for features that
are switched off (``"flops_profiler": {"enabled": false}``,
``"zero_force_ds_cpu_optimizer": true``). Rejecting those as unknown
keys would make switching from DeepSpeed needlessly painful; accepting them
when they are *on* would silently train differently from what the user asked.
So each key is accepted exactly when its value means "feature off" (the
"neutral" value, DeepSpeed's default) and is otherwise an error that says the
feature is not implemented. Accepted keys are dropped before validation.

A few keys are pure performance knobs whose every value trains to the same
numbers (``cpuadam_cores_perc``): those are accepted at any value DeepSpeed
itself accepts, since refusing them would only make users delete lines.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

from .errors import ConfigError, join_path

logger = logging.getLogger(__name__)


class Neutral(NamedTuple):
    """How a feature's key reads when the feature is off (null always does, {} unless kind is "null")."""

    hint: str                    # completes "remove it or ..."
    accepted: str                # for the reference: the values accepted
    kind: str                    # "enabled": an object whose "enabled" is in `values`
                                 # "empty": an object whose values are all null/false
                                 # "value": exactly one of `values`
                                 # "check": `values[0](value)` is true
                                 # "null": only null (the block's presence, even {}, switches it on)
    values: Tuple[Any, ...] = ()

    def accepts(self, value: Any) -> bool:
        if value is None:
            return True
        if self.kind == "null":
            return False
        if value == {}:
            return True
        if self.kind == "enabled":
            return isinstance(value, dict) and _is_one_of(value.get("enabled", False), self.values)
        if self.kind == "empty":
            return isinstance(value, dict) and all(v is None or v is False for v in value.values())
        if self.kind == "check":
            return bool(self.values[0](value))
        return _is_one_of(value, self.values)


def _is_one_of(value: Any, options: Tuple[Any, ...]) -> bool:
    # Booleans only match booleans: 0 is not "false" and 1 is not "true" here.
    return any(value is o if isinstance(o, bool) or isinstance(value, bool) else value == o for o in options)


ENABLED_FALSE = Neutral("set enabled=false", "`enabled: false`", "enabled", (False,))
EMPTY = Neutral("set its values to null", "every value null or false", "empty")
NULL_ONLY = Neutral("set it to null", "`null` (any block, even `{}`, switches the feature on)", "null")


def off_value(value: Any) -> Neutral:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return Neutral(f"set it to {text}", f"`{text}`", "value", (value,))


def checked(hint: str, accepted: str, check: Callable[[Any], bool]) -> Neutral:
    """Neutral values described by a predicate (several spellings, or any value of a harmless knob)."""
    return Neutral(hint, accepted, "check", (check,))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has_only(value: Any, keys: Tuple[str, ...]) -> bool:
    return isinstance(value, dict) and set(value) <= set(keys)


# Performance knobs: every value gives the same numbers, so any value DeepSpeed accepts is fine.
ANY_BOOL = checked("set it to true or false", "`true` or `false` (no effect on results)",
                   lambda v: isinstance(v, bool))
ANY_FRACTION = checked("set it to a number from 0 to 1", "a number from 0 to 1 (no effect on results)",
                       lambda v: _is_number(v) and 0 <= v <= 1)

# DeepSpeed's default ZeRO-3 leaf modules (HuggingFace MoE blocks); a single string counts as a list.
_LEAF_DEFAULTS = {
    "classes": {"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"},
    "names": set(),
    "name_suffixes": set(),
}


def _leaf_module_is_default(value: Any) -> bool:
    if not _has_only(value, tuple(_LEAF_DEFAULTS)):
        return False
    for key, listed in value.items():
        items = [listed] if isinstance(listed, str) else listed
        if not isinstance(items, list) or set(items) != _LEAF_DEFAULTS[key]:
            return False
    return True


def _timers_are_valid(value: Any) -> bool:
    # Only the throughput log line; zeroengine's steps_per_print report already carries the rate.
    if not _has_only(value, ("throughput",)):
        return False
    throughput = value.get("throughput") or {}
    return _has_only(throughput, ("enabled", "synchronized")) and all(isinstance(v, bool)
                                                                       for v in throughput.values())


def _weight_quantization_is_off(value: Any) -> bool:
    # DeepSpeed quantizes only when one of these sub-blocks is filled in (or never, when disabled).
    return isinstance(value, dict) and (value.get("enabled", True) is False or not any(
        value.get(k) for k in ("quantized_initialization", "post_init_quant")))


def _is_whole_or_null(value: Any) -> bool:
    return value is None or (_is_number(value) and value >= 0 and float(value).is_integer())


def _data_types_are_default(value: Any) -> bool:
    # keep_in_fp32_modules "auto" is DeepSpeed's default; the dtype overrides default to null.
    if not _has_only(value, ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")):
        return False
    return (all(value.get(k) is None for k in ("grad_accum_dtype", "param_dtype", "buffer_dtype"))
            and value.get("keep_in_fp32_modules", "auto") in (None, "auto"))


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
        Unsupported("autotuning", ENABLED_FALSE, "automatic search of ZeRO/batch settings"),
        Unsupported("comet", ENABLED_FALSE, "Comet experiment logging"),
        Unsupported("comms_logger", ENABLED_FALSE, "logging of every collective"),
        Unsupported("compression_training", EMPTY, "quantization/pruning-aware training"),
        Unsupported("curriculum_learning", ENABLED_FALSE, "sequence-length curriculum"),
        Unsupported("data_efficiency", ENABLED_FALSE, "data sampling and routing library"),
        Unsupported("data_types", checked("set its dtypes to null and keep_in_fp32_modules to \"auto\"",
                                          "dtypes null, `keep_in_fp32_modules` `\"auto\"`",
                                          _data_types_are_default),
                    "separate gradient-accumulation, parameter and buffer dtypes, and buffers kept in fp32; "
                    "zeroengine casts every floating parameter and buffer to the training dtype"),
        Unsupported("datastates_ckpt", off_value(False), "DataStates-LLM asynchronous checkpointing"),
        Unsupported("disable_allgather", off_value(False), "skipping the parameter all-gather"),
        Unsupported("disable_python_gc", ANY_BOOL, "switching off Python's cyclic garbage collector while the "
                    "engine lives (speed only; zeroengine leaves the collector alone)"),
        Unsupported("dump_state", off_value(False), "printing the engine state at startup"),
        Unsupported("eigenvalue", ENABLED_FALSE, "Hessian eigenvalue computation"),
        Unsupported("elasticity", ENABLED_FALSE, "elastic batch sizes across world sizes"),
        Unsupported("flops_profiler", ENABLED_FALSE, "FLOPs profiler"),
        Unsupported("gradient_allreduce_op", checked("set it to \"mean\"", "`\"mean\"` (any capitalisation)",
                                                     lambda v: isinstance(v, str) and v.lower() == "mean"),
                    "summing instead of averaging gradients over data-parallel ranks; zeroengine averages "
                    "(for summed gradients multiply the loss by the data-parallel world size)"),
        Unsupported("graph_harvesting", off_value(False), "accelerator graph capture and replay (removed "
                    "in DeepSpeed 0.19.8, which refuses the key at any value)"),
        Unsupported("hybrid_engine", ENABLED_FALSE, "RLHF inference/training hybrid engine"),
        Unsupported("managed_gradient_accumulation", off_value(True),
                    "letting step() be the accumulation boundary with a variable number of backward calls; "
                    "zeroengine counts gradient_accumulation_steps (or use set_gradient_accumulation_boundary)"),
        Unsupported("memory_breakdown", off_value(False), "memory-usage logging; zeroengine offers "
                    "engine.memory_breakdown() instead"),
        Unsupported("nebula", ENABLED_FALSE, "Azure Nebula checkpoint service"),
        Unsupported("progressive_layer_drop", ENABLED_FALSE, "progressive layer dropping"),
        Unsupported("quantize_training", ENABLED_FALSE, "MoQ quantize-aware training"),
        Unsupported("sparse_attention", EMPTY, "block-sparse attention kernels"),
        Unsupported("sparse_gradients", off_value(False), "sparse embedding gradients"),
        Unsupported("timers", checked("set throughput.enabled/synchronized to true or false",
                                      "`throughput: {enabled, synchronized}`, any booleans (a log line only)",
                                      _timers_are_valid),
                    "the throughput timer's log line; zeroengine's steps_per_print line already reports "
                    "samples per second"),
        Unsupported("torch_autocast", ENABLED_FALSE, "torch.autocast-based mixed precision"),
        Unsupported("use_data_before_expert_parallelism", off_value(False),
                    "placing data-parallel ranks before expert-parallel ones; zeroengine always builds "
                    "DeepSpeed's default layout (expert-parallel groups of consecutive ranks)"),
        Unsupported("vocabulary_size", checked("set it to a whole number or null",
                                               "a whole number or null (no effect on results)",
                                               _is_whole_or_null),
                    "the vocabulary size, which DeepSpeed only checks for tensor-core alignment (a warning)"),
        Unsupported("wandb", ENABLED_FALSE, "Weights & Biases logging"),
        Unsupported("weight_quantization", checked("set enabled=false",
                                                   "`enabled: false`, or no `quantized_initialization` / "
                                                   "`post_init_quant`", _weight_quantization_is_off),
                    "quantized weight initialization (zero.Init) and post-init quantization"),
        Unsupported("zero_force_ds_cpu_optimizer", ANY_BOOL, "requiring DeepSpeed's CPU optimizer with "
                    "offload (DeepSpeed refuses a client optimizer unless this is false; zeroengine steps a client "
                    "optimizer on the offloaded fp32 masters at either value)"),
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
        Unsupported("zenflow", NULL_ONLY, "ZenFlow stall-free offload"),
        Unsupported("stage3_model_persistence_threshold",
                    checked(f"set it to {sys.maxsize} (sys.maxsize, no cap)", f"`{sys.maxsize}` (no cap) or more",
                            lambda v: _is_number(v) and v >= sys.maxsize),
                    "a cap on the total elements kept gathered by stage3_param_persistence_threshold; "
                    "zeroengine has no cap: lower stage3_param_persistence_threshold instead"),
        Unsupported("stage3_module_granularity_threshold", off_value(0),
                    "fetching fine-grained modules' parameters as one unit; zeroengine fetches per "
                    "module as it runs"),
        Unsupported("stage3_use_all_reduce_for_fetch_params", ANY_BOOL,
                    "all-reduce instead of all-gather to fetch stage-3 parameters (same values either way; "
                    "zeroengine all-gathers)"),
        Unsupported("use_multi_rank_bucket_allreduce", ANY_BOOL,
                    "one all-reduce for several ranks' reduce buckets (a message-size optimisation; "
                    "zeroengine reduces with its own buckets)"),
        Unsupported("memory_efficient_linear", ANY_BOOL,
                    "a stage-3 linear that does not keep the gathered weight for backward (memory only; "
                    "zeroengine uses torch's linear)"),
        Unsupported("compute_grad_norm", off_value(True),
                    "skipping the global gradient norm at stages 1-2; zeroengine always computes it "
                    "(clipping, get_global_grad_norm)"),
        Unsupported("parameter_alignment", off_value(False),
                    "padding stage 1-2 flat buffers so each parameter starts 16-byte aligned"),
        Unsupported("leaf_module", checked("set it to DeepSpeed's default (the Mixtral/Qwen2-MoE/Qwen3-MoE "
                                           "sparse MoE block classes)",
                                           "DeepSpeed's default lists (three HuggingFace MoE block `classes`, "
                                           "no `names` or `name_suffixes`)", _leaf_module_is_default),
                    "user-chosen ZeRO-3 leaf modules whose submodules get no fetch hooks; zeroengine has "
                    "no leaf modules"),
        Unsupported("stage3_allgather_sequential", ANY_BOOL,
                    "all-gathering stage-3 parameters one by one instead of in buckets (copies and memory only; "
                    "the gathered values are the same)"),
        Unsupported("override_module_apply", off_value(True),
                    "gathering parameters for Module.apply under zero.Init; zeroengine.zero.Init always gives "
                    "initialisation code (Module.apply included) the full parameter values"),
        Unsupported("log_trace_cache_warnings", ANY_BOOL, "logging stage-3 trace-cache invalidations"),
        Unsupported("enable_sanity_checks", ANY_BOOL,
                    "internal stage-3 consistency checks while debugging (zeroengine's comm_debug checks "
                    "collectives instead)"),
        Unsupported("pipeline_loading_checkpoint", ANY_BOOL, "a flag DeepSpeed 0.19.8 defines but never reads"),
        Unsupported("save_muon_momentum_buffer_in_memory", ANY_BOOL,
                    "keeping Muon's momentum out of NVMe swapping (NVMe offload and Muon only)"),
        Unsupported("zeropp_loco_param", off_value(None), "LoCo error feedback for ZeRO++ quantized gradients "
                    "(removed in DeepSpeed 0.19.8, which refuses the key at any value)"),
    ),
    "optimizer": (
        Unsupported("legacy_fusion", off_value(False), "the pre-0.3 fused fp16 optimizer wrapper"),
    ),
    "zero_optimization.offload_optimizer": (
        Unsupported("super_offload", off_value(False), "SuperOffload for Superchips"),
        Unsupported("cpuadam_cores_perc", ANY_FRACTION, "share of CPU cores SuperOffload's CPU Adam uses "
                    "(SuperOffload only; zeroengine's CPU Adam uses torch's threads)"),
    ),
    "zero_optimization.offload_param": (
    ),
    "fp16": (
        Unsupported("fp16_master_weights_and_grads", off_value(False), "fp16 master weights"),
    ),
    "bf16": (
        Unsupported("immediate_grad_update", ANY_BOOL, "accumulating each micro-batch's bf16 gradients "
                    "into fp32 in the backward hooks rather than after backward (same sums either way)"),
    ),
    "checkpoint": (
        Unsupported("parallel_write", EMPTY, "pipeline-stage parallel checkpoint writes"),
        Unsupported("writer", off_value(None), "DeepSpeed's fast checkpoint writer"),
        Unsupported("checkpoint_serialization", off_value(True), "legacy torch.save serialization switch"),
        Unsupported("use_node_local_storage", off_value(False),
                    "checkpoints on node-local (not shared) disks: zeroengine stores shards by parameter range, "
                    "so loading (at any world size or stage) may read any rank's shard, and the shared files "
                    "are written once; save to a filesystem every rank can read"),
    ),
}


def unsupported_keys_at(section: str) -> List[str]:
    """Unimplemented-feature keys accepted (when neutral) under ``section``."""
    return [entry.key for entry in UNSUPPORTED.get(section, ())]


# NVMe offload's own keys and their defaults. They configure nothing while the offload device is not NVMe:
# Lightning's presets write them beside "device": "cpu" (nvme_path "/local_nvme", ...); one line says so.
_NVME_ONLY = {
    "zero_optimization.offload_optimizer": {"nvme_path": None, "buffer_count": 4, "pipeline_read": False,
                                            "pipeline_write": False, "fast_init": False},
    "zero_optimization.offload_param": {"nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000,
                                        "max_in_cpu": 1_000_000_000},
}


def drop_inert_nvme_keys(data: Dict[str, Any]) -> None:
    """Remove NVMe-only offload keys from offload blocks whose device is not NVMe, saying so in one line."""
    for section, defaults in _NVME_ONLY.items():
        block = _find(data, section)
        if not isinstance(block, dict) or block.get("device") == "nvme":
            continue
        present = [key for key in defaults if key in block]
        if any(block[key] != defaults[key] for key in present):
            logger.info("config: %s.{%s} ignored: they configure NVMe offload, and the device is %r",
                        section, ", ".join(present), block.get("device"))
        for key in present:
            del block[key]


def drop_unsupported_features(data: Dict[str, Any]) -> None:
    """Remove neutral unimplemented-feature keys from ``data``; raise for any that is switched on."""
    drop_inert_nvme_keys(data)
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
