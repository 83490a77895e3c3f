"""DeepSpeed 0.19.8 keys zeroengine does not implement: they load at DeepSpeed's defaults, and only there.

Defaults were read from the installed DeepSpeed 0.19.8 (runtime/zero/config.py,
zero/offload_config.py, zero/leaf_module_config.py, precision_config.py,
tensor_parallel/config.py, utils/config.py, runtime/constants.py); they are
written out here rather than imported because the package must never import
DeepSpeed. configs/deepspeed_0_19_8_keys.json lists every key DeepSpeed 0.19.8
reads, with its default (made by scripts/list_deepspeed_keys.py): none of them
may be an unknown key here.
"""
import json
import logging
import os
import sys

import pytest
import torch

import zeroengine
from zeroengine.config import ConfigError, load_config
from zeroengine.config.legacy import LEGACY_KEYS
from zeroengine.config.unsupported import UNSUPPORTED
from zeroengine.optim.factory import build_optimizer
from zeroengine.optim.schedulers import build_scheduler

BASE = {"train_batch_size": 8}
_MOE_BLOCKS = ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
               "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
               "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]

# (section, key, DeepSpeed's default, a value zeroengine must refuse, what the refusal must say)
KEYS = [
    ("bf16", "immediate_grad_update", False, "yes", "true or false"),
    ("zero_optimization", "stage3_model_persistence_threshold", sys.maxsize, 100_000,
     "lower stage3_param_persistence_threshold"),
    ("zero_optimization", "stage3_module_granularity_threshold", 0, 1000, "set it to 0"),
    ("zero_optimization", "stage3_use_all_reduce_for_fetch_params", False, "true", "true or false"),
    ("zero_optimization", "use_multi_rank_bucket_allreduce", True, 0, "true or false"),
    ("zero_optimization", "memory_efficient_linear", True, None, None),  # no refused value: any bool works
    ("zero_optimization", "compute_grad_norm", True, False, "always computes it"),
    ("zero_optimization", "parameter_alignment", False, True, "set it to false"),
    ("zero_optimization", "leaf_module", {"classes": _MOE_BLOCKS, "names": [], "name_suffixes": []},
     {"classes": ["my_model.MyMoE"]}, "no leaf modules"),
    ("zero_optimization.offload_optimizer", "cpuadam_cores_perc", 0.8, 1.5, "from 0 to 1"),
    ("", "graph_harvesting", False, True, "set it to false"),
    ("", "timers", {"throughput": {"enabled": True, "synchronized": True}},
     {"throughput": {"enabled": "yes"}}, "throughput"),
    ("", "weight_quantization", {"quantized_initialization": {}, "post_init_quant": {}},
     {"quantized_initialization": {"num_bits": 8, "group_size": 64}}, "set enabled=false"),
    ("", "use_data_before_expert_parallelism", False, True, "set it to false"),
    ("zero_optimization", "stage3_allgather_sequential", False, "yes", "true or false"),
    ("zero_optimization", "override_module_apply", True, False, "full parameter values"),
    ("zero_optimization", "log_trace_cache_warnings", False, 1, "true or false"),
    ("zero_optimization", "enable_sanity_checks", False, "on", "true or false"),
    ("zero_optimization", "pipeline_loading_checkpoint", False, "no", "never reads"),
    ("zero_optimization", "save_muon_momentum_buffer_in_memory", False, 0, "true or false"),
    ("zero_optimization", "zeropp_loco_param", None, {"err_beta": 0.8}, "set it to null"),
    ("zero_optimization", "zenflow", None, {}, "set it to null"),  # DeepSpeed: any block switches it on
    ("optimizer", "legacy_fusion", False, True, "set it to false"),
    ("", "managed_gradient_accumulation", True, False, "set_gradient_accumulation_boundary"),
    ("", "gradient_allreduce_op", "mean", "sum", "multiply the loss by the data-parallel world size"),
    ("", "disable_python_gc", False, "yes", "true or false"),
    ("", "datastates_ckpt", False, {"host_cache_size": 16}, "set it to false"),
    ("", "vocabulary_size", None, "50257", "whole number"),
    ("", "data_types", {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None,
                        "keep_in_fp32_modules": "auto"}, {"grad_accum_dtype": "fp32"}, "training dtype"),
]


def config_with(section, key, value):
    """BASE plus ``key: value`` inside ``section`` (stage 3 with CPU optimizer offload, so every section exists)."""
    cfg = {**BASE, "bf16": {"enabled": True}, "optimizer": {"type": "Adam"},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    block = cfg
    for part in section.split(".") if section else ():
        block = block[part]
    block[key] = value
    return cfg


def _id(row):
    return f"{row[0]}.{row[1]}" if row[0] else row[1]


@pytest.mark.parametrize("section,key,default,bad,says", KEYS, ids=[_id(r) for r in KEYS])
def test_deepspeed_default_loads(section, key, default, bad, says):
    cfg = load_config(config_with(section, key, default))
    assert cfg.zero_stage == 3 and cfg.bf16.enabled
    block = cfg.to_dict()
    for part in section.split(".") if section else ():
        block = block[part]
    assert key not in block  # dropped before validation: nothing downstream sees it


@pytest.mark.parametrize("section,key,default,bad,says", [r for r in KEYS if r[3] is not None],
                         ids=[_id(r) for r in KEYS if r[3] is not None])
def test_other_values_are_refused_with_the_key_path(section, key, default, bad, says):
    with pytest.raises(ConfigError) as info:
        load_config(config_with(section, key, bad))
    path = f"{section}.{key}" if section else key
    assert info.value.key_path == path
    message = str(info.value)
    assert message.startswith(f"{path}: '{key}' is a DeepSpeed feature zeroengine does not implement")
    assert says in message


def test_every_row_is_in_the_unsupported_table():
    listed = {(section, entry.key) for section, entries in UNSUPPORTED.items() for entry in entries}
    assert {(row[0], row[1]) for row in KEYS} <= listed


@pytest.mark.parametrize("section,key,value", [
    ("zero_optimization", "memory_efficient_linear", False),
    ("zero_optimization", "use_multi_rank_bucket_allreduce", False),
    ("zero_optimization", "stage3_use_all_reduce_for_fetch_params", True),
    ("zero_optimization.offload_optimizer", "cpuadam_cores_perc", 0.25),
    ("bf16", "immediate_grad_update", True),
    ("", "timers", {"throughput": {"enabled": False}}),
    ("", "tensor_parallel", {"autotp_size": 1, "tp": {"tp_size": 1}, "tp_overlap_comm": True}),
    ("", "weight_quantization", {"enabled": False, "quantized_initialization": {"num_bits": 8}}),
    ("zero_optimization", "leaf_module", {"classes": list(reversed(_MOE_BLOCKS))}),
    ("zero_optimization", "stage3_model_persistence_threshold", 9.223372036854776e18),
    ("zero_optimization", "stage3_allgather_sequential", True),
    ("", "gradient_allreduce_op", "MEAN"),  # DeepSpeed lower-cases it
    ("", "disable_python_gc", True),
    ("", "vocabulary_size", 50257),
    ("", "aio", {"queue_depth": 32, "single_submit": True}),  # only NVMe offload reads them
    ("", "compile", {"deepcompile": False, "offload_activation": True}),
    ("", "data_types", {"keep_in_fp32_modules": "auto"}),
])
def test_values_that_change_nothing_load(section, key, value):
    """Performance knobs at any value, and other spellings of "off" (results are the same as without the key)."""
    assert load_config(config_with(section, key, value)).zero_stage == 3


def test_sequence_parallel_keys():
    cfg = load_config({**BASE, "sequence_parallel_size": 2, "seq_parallel_communication_data_type": "BF16"})
    assert cfg.sequence_parallel_size == 2 and cfg.seq_parallel_communication_data_type == "bf16"
    assert load_config(BASE).seq_parallel_communication_data_type == "fp32"  # DeepSpeed's default
    for key, bad, says in (("sequence_parallel_size", 0, "sequence_parallel_size"),
                           ("seq_parallel_communication_data_type", "int8", "seq_parallel_communication_data_type")):
        with pytest.raises(ConfigError, match=says):
            load_config({**BASE, key: bad})


@pytest.mark.parametrize("value,size", [({"autotp_size": 4}, 4), ({"tp": {"tp_size": 2}}, 2), ({"autotp_size": 0}, 1)])
def test_tensor_parallel_size(value, size):
    assert load_config({**BASE, "tensor_parallel": value}).tensor_parallel.size == size


@pytest.mark.parametrize("value,match", [
    ({"autotp_sise": 2}, "did you mean 'autotp_size'"),  # a misspelt switch is not silently "off"
    ({"autotp_size": 2, "tp": {"tp_size": 4}}, "differs from autotp_size"),
    ({"autotp_size": 2, "replace_with_kernel_inject": True}, "not implemented"),
])
def test_tensor_parallel_errors_name_the_key(value, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config({**BASE, "tensor_parallel": value})
    assert info.value.key_path.startswith("tensor_parallel")


def test_leaf_module_string_counts_as_a_one_element_list():
    # DeepSpeed coerces a string to a list; an extra user name is a non-default leaf module.
    with pytest.raises(ConfigError) as info:
        load_config(config_with("zero_optimization", "leaf_module", {"names": "model.layers.0.mlp"}))
    assert info.value.key_path == "zero_optimization.leaf_module"


def test_all_keys_together_load_like_a_config_without_them():
    full = config_with("", "train_batch_size", 8)
    for section, key, default, _, _ in KEYS:
        full = _merge(full, config_with(section, key, default))
    assert load_config(full).to_dict() == load_config(config_with("", "train_batch_size", 8)).to_dict()


def _merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("typo,meant", [
    ("tensor_paralel", "tensor_parallel"),
    ("timer", "timers"),
    ("expert_paralel", "expert_parallel"),
])
def test_typos_suggest_the_deepspeed_key(typo, meant):
    with pytest.raises(ConfigError, match=f"did you mean '{meant}'"):
        load_config({**BASE, typo: {}})


# -- every key DeepSpeed 0.19.8 reads ------------------------------------------------------------

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "deepspeed_0_19_8_keys.json")) as f:
    DS_KEYS = json.load(f)["keys"]

# Blocks whose mere presence switches a DeepSpeed feature on, even filled with DeepSpeed's defaults.
SWITCHED_ON_BY_PRESENCE = ("zero_optimization.zenflow", "checkpoint.writer")


def _ds_config(section, key, value):
    cfg = {**BASE}
    if section == "optimizer":
        cfg["optimizer"] = {"type": "Adam"}
    if section.startswith("zero_optimization"):
        cfg["zero_optimization"] = {"stage": 3}
    block = cfg
    for part in section.split(".") if section else ():
        block = block.setdefault(part, {})
        if part.startswith("offload_"):
            block.setdefault("device", "cpu")
    block[key] = value
    return cfg


def test_the_key_list_is_deepspeed_0_19_8_and_complete_enough():
    assert len(DS_KEYS) > 300
    listed = {(s, k) for s, k, _ in DS_KEYS}
    # a few keys the issue named, from different parsers
    assert {("zero_optimization", "stage3_allgather_sequential"), ("", "log_level"),
            ("", "managed_gradient_accumulation"), ("", "disable_python_gc"), ("", "gradient_allreduce_op"),
            ("zero_optimization.offload_optimizer", "ratio"), ("aio", "block_size")} <= listed


@pytest.mark.parametrize("section,key,default", DS_KEYS, ids=[f"{s}.{k}" if s else k for s, k, _ in DS_KEYS])
def test_no_deepspeed_key_is_unknown(section, key, default):
    """At DeepSpeed's default every key loads, except inside blocks whose presence alone enables a feature,
    which are refused naming the block (never 'unknown key')."""
    cfg = _ds_config(section, key, default)
    block = next((b for b in SWITCHED_ON_BY_PRESENCE if section == b), None)
    if block is None:
        load_config(cfg)
        return
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.key_path == block and "does not implement" in str(info.value)


@pytest.mark.parametrize("name", ["prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                                  "max_reuse_distance"])
def test_deepspeed_field_names_of_stage3_keys_are_the_stage3_keys(name):
    cfg = load_config({**BASE, "zero_optimization": {"stage": 3, name: 12345}})
    assert getattr(cfg.zero_optimization, f"stage3_{name}") == 12345
    with pytest.raises(ConfigError, match="given twice") as info:
        load_config({**BASE, "zero_optimization": {"stage": 3, name: 1, f"stage3_{name}": 2}})
    assert info.value.key_path == f"zero_optimization.stage3_{name}"
    assert any(entry.old == name for entry in LEGACY_KEYS)


def test_deepspeed_field_names_reach_unsupported_keys_too():
    with pytest.raises(ConfigError, match="set it to 0") as info:
        load_config({**BASE, "zero_optimization": {"stage": 3, "module_granularity_threshold": 100}})
    assert info.value.key_path == "zero_optimization.stage3_module_granularity_threshold"


def test_deprecated_cpu_offload_flags_at_null_are_absent():
    cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": None, "cpu_offload_param": None,
                                                      "cpu_offload_use_pin_memory": None}})
    assert cfg.zero_optimization.offload_optimizer is None and cfg.zero_optimization.offload_param is None


def test_log_level_is_honoured_by_initialize():
    assert load_config({**BASE, "log_level": "WARNING"}).log_level == "warning"
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "log_level": "verbose"})
    assert info.value.key_path == "log_level"
    logger = logging.getLogger("zeroengine")
    before = logger.level, [(handler, handler.level) for handler in logger.handlers]
    try:
        model = torch.nn.Linear(2, 2)
        zeroengine.initialize(model=model, model_parameters=model.parameters(),
                              config={**BASE, "log_level": "error", "optimizer": {"type": "SGD"}})
        assert logger.level == logging.ERROR
        assert not logging.getLogger("zeroengine.optim.factory").isEnabledFor(logging.WARNING)
    finally:
        logger.setLevel(before[0])
        for handler, level in before[1]:
            handler.setLevel(level)


def test_deepspeed_adam_flags_load_at_their_defaults_and_build():
    params = {"lr": 0.01, "set_grad_none": True, "fp32_optimizer_states": True}
    cfg = load_config({**BASE, "optimizer": {"type": "AdamW", "params": params}})
    opt = build_optimizer(cfg.optimizer.type, cfg.optimizer.params, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 0.01
    for key in ("set_grad_none", "fp32_optimizer_states"):
        with pytest.raises(ConfigError, match=f"{key}=false is not supported") as info:
            load_config({**BASE, "optimizer": {"type": "Adam", "params": {key: False}}})
        assert info.value.key_path == f"optimizer.params.{key}"


@pytest.mark.parametrize("type_name,params", [
    ("WarmupLR", {"warmup_num_steps": 4}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 4}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}),
])
def test_scheduler_last_batch_iteration_starts_part_way(type_name, params):
    """DeepSpeed's schedules take last_batch_iteration; built with 2, the schedule is where a fresh one is
    after three steps."""
    def build(extra):
        cfg = load_config({**BASE, "scheduler": {"type": type_name, "params": {**params, **extra}}})
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
        return build_scheduler(cfg.scheduler.type, cfg.scheduler.params, opt)

    fresh, resumed = build({}), build({"last_batch_iteration": 2})
    for _ in range(3):
        fresh.step()
    assert resumed.get_lr() == fresh.get_lr() != build({}).get_lr()
    with pytest.raises(ConfigError) as info:
        build({"last_batch_iteration": -2})
    assert info.value.key_path == "scheduler.params.last_batch_iteration"


def test_the_compile_section_takes_deepspeeds_keys_and_refuses_deepcompile():
    cfg = load_config(config_with("", "compile", {"enabled": True, "backend": "aot_eager", "kwargs": {"dynamic": False},
                                                  "deepcompile": False, "free_activation_threshold": 10485760}))
    assert (cfg.compile.enabled, cfg.compile.backend, cfg.compile.kwargs) == (True, "aot_eager", {"dynamic": False})
    with pytest.raises(ConfigError) as info:
        load_config(config_with("", "compile", {"deepcompile": True}))
    assert info.value.key_path == "compile.deepcompile" and "DeepCompile" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(config_with("", "compile", {"enabeld": True}))  # a misspelt switch is not silently "off"
    assert info.value.key_path == "compile.enabeld"


def test_bf16_masters_and_states_load_where_built_and_name_their_key_elsewhere():
    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                                          "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {}}}
    cfg = load_config(base)
    assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states
    for change, words in ((lambda c: c["bf16"].update(bf16_master_weights_and_grads=False), "needs bf16_master"),
                          (lambda c: c["zero_optimization"].update(stage=0), "stage 1, 2 or 3"),
                          (lambda c: c["bf16"].update(enabled=False), "bf16.enabled")):
        bad = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
        change(bad)
        with pytest.raises(ConfigError) as info:
            load_config(bad)
        assert info.value.key_path.startswith("bf16.bf16_") and words in str(info.value)
