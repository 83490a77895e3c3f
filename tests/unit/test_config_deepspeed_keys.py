"""DeepSpeed 0.19.8 keys zeroengine does not implement: they load at DeepSpeed's defaults, and only there.

Defaults were read from the installed DeepSpeed 0.19.8 (runtime/zero/config.py,
zero/offload_config.py, zero/leaf_module_config.py, precision_config.py,
tensor_parallel/config.py, utils/config.py, runtime/constants.py); they are
written out here rather than imported because the package must never import
DeepSpeed.
"""
import sys

import pytest

from zeroengine.config import ConfigError, load_config
from zeroengine.config.unsupported import UNSUPPORTED

BASE = {"train_batch_size": 8}
_MOE_BLOCKS = ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
               "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
               "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]

# (section, key, DeepSpeed's default, a value zeroengine must refuse, what the refusal must say)
KEYS = [
    ("bf16", "bf16_master_weights_and_grads", False, True, "keeps them in fp32"),
    ("bf16", "bf16_optimizer_states", False, True, "keeps them in fp32"),
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
    ("", "seq_parallel_communication_data_type", "fp32", "int8", "no sequence parallelism"),
    ("", "graph_harvesting", False, True, "set it to false"),
    ("", "tensor_parallel", {"autotp_size": 0}, {"autotp_size": 2}, "set autotp_size to 0"),
    ("", "timers", {"throughput": {"enabled": True, "synchronized": True}},
     {"throughput": {"enabled": "yes"}}, "throughput"),
    ("", "expert_parallel", {"enabled": False}, {"enabled": True, "autoep_size": 2}, "zeroengine.moe.MoE"),
    ("", "weight_quantization", {"quantized_initialization": {}, "post_init_quant": {}},
     {"quantized_initialization": {"num_bits": 8, "group_size": 64}}, "set enabled=false"),
    ("", "use_data_before_expert_parallelism", False, True, "set it to false"),
]


def config_with(section, key, value):
    """BASE plus ``key: value`` inside ``section`` (stage 3 with CPU optimizer offload, so every section exists)."""
    cfg = {**BASE, "bf16": {"enabled": True},
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
    ("", "seq_parallel_communication_data_type", "BF16"),
    ("", "timers", {"throughput": {"enabled": False}}),
    ("", "tensor_parallel", {"autotp_size": 1, "tp": {"tp_size": 1}, "tp_overlap_comm": True}),
    ("", "weight_quantization", {"enabled": False, "quantized_initialization": {"num_bits": 8}}),
    ("zero_optimization", "leaf_module", {"classes": list(reversed(_MOE_BLOCKS))}),
    ("zero_optimization", "stage3_model_persistence_threshold", 9.223372036854776e18),
])
def test_values_that_change_nothing_load(section, key, value):
    """Performance knobs at any value, and other spellings of "off" (results are the same as without the key)."""
    assert load_config(config_with(section, key, value)).zero_stage == 3


@pytest.mark.parametrize("value", [
    {"autotp_size": 4},
    {"tp": {"tp_size": 2}},
    {"autotp_sise": 0},  # a misspelt switch is not silently "off"
])
def test_tensor_parallel_switched_on_or_misspelt_is_refused(value):
    with pytest.raises(ConfigError, match="AutoTP") as info:
        load_config({**BASE, "tensor_parallel": value})
    assert info.value.key_path == "tensor_parallel"


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


def test_tensor_parallel_is_no_longer_an_unknown_key_suggesting_tensorboard():
    # Before these keys were known, 'tensor_parallel' was "unknown key; did you mean 'tensorboard'?".
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "tensor_parallel": {"autotp_size": 8}})
    assert "tensorboard" not in str(info.value) and "unknown key" not in str(info.value)
