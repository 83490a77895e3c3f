"""Configs in the style real DeepSpeed users write load, and resolve to the expected values."""
import copy
import json
from pathlib import Path

import pytest
import torch

from zeroengine.config import ConfigError, ZeroEngineConfig, load_config

CONFIGS = Path(__file__).parent / "configs"


def test_huggingface_zero2_template_with_auto_everywhere():
    cfg = load_config(CONFIGS / "hf_ds_config_zero2.json", world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 1, 1)
    assert cfg.gradient_clipping == 1.0
    assert not cfg.fp16.enabled and not cfg.bf16.enabled
    assert cfg.precision_dtype is torch.float32
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 0}
    zero = cfg.zero_optimization
    assert cfg.zero_stage == 2 and zero.overlap_comm and zero.reduce_scatter and zero.contiguous_gradients
    assert zero.reduce_bucket_size == 200_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.allgather_bucket_size == 200_000_000
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    assert zero.offload_param is None
    assert cfg.steps_per_print == 2000 and cfg.wall_clock_breakdown is False


@pytest.mark.parametrize("hidden, reduce, prefetch, persist", [
    (1024, 1024 * 1024, int(0.9 * 1024 * 1024), 10 * 1024),
    (4096, 4096 * 4096, int(0.9 * 4096 * 4096), 40960),
    (None, 500_000_000, 50_000_000, 100_000),    # no hidden size: DeepSpeed's defaults
])
def test_huggingface_zero3_template_resolves_buckets_from_hidden_size(hidden, reduce, prefetch, persist):
    cfg = load_config(CONFIGS / "hf_ds_config_zero3.json", world_size=2, hidden_size=hidden)
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (reduce, prefetch, persist)
    assert cfg.zero_stage == 3
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory
    assert zero.offload_optimizer.device == "cpu"
    assert zero.sub_group_size == 10**9 and zero.stage3_max_live_parameters == 10**9
    assert zero.stage3_gather_16bit_weights_on_model_save
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 1)
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 0,
                                    "total_num_steps": 10000}


def test_megatron_style_fp16_config_with_scientific_notation():
    cfg = load_config(CONFIGS / "megatron_fp16.json", world_size=8)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (512, 8, 8)
    assert cfg.precision_dtype is torch.float16
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
            fp16.hysteresis, fp16.min_loss_scale) == (True, 0.0, 11, 500, 2, 1.0)
    assert cfg.optimizer.params == {"lr": 1.5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    assert cfg.scheduler.params == {"total_num_steps": 300_000, "warmup_num_steps": 2000,
                                    "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}
    assert type(cfg.scheduler.params["total_num_steps"]) is int
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.activation_checkpointing.partition_activations
    assert cfg.activation_checkpointing.number_checkpoints == 24
    # DeepSpeed's top-level "tensorboard" block lands in monitor.
    assert cfg.monitor.tensorboard.enabled and cfg.monitor.tensorboard.job_name == "gpt2_350m"
    assert cfg.monitor.enabled and not cfg.monitor.csv.enabled


def test_hjson_file_with_comments_and_trailing_commas():
    cfg = load_config(CONFIGS / "commented.hjson", world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 2, 4)
    assert cfg.precision_dtype is torch.bfloat16
    assert cfg.zero_stage == 3 and cfg.zero_optimization.overlap_comm      # stage 3 default
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.zero_optimization.stage3_max_live_parameters == 300_000_000
    assert cfg.optimizer.type == "SGD"                                    # written "sgd"
    assert cfg.optimizer.params == {"lr": 0.05, "momentum": 0.9, "nesterov": True}
    assert cfg.checkpoint.tag_validation == "Fail"                        # written "fail"
    assert cfg.comm_debug is True


def test_json_file_with_comments_loads_too():
    cfg = load_config(str(CONFIGS / "commented.json"), world_size=1)
    assert cfg.train_batch_size == 16 and cfg.zero_stage == 2 and cfg.gradient_clipping == 0.5


def test_deprecated_aliases_and_switched_off_deepspeed_features():
    cfg = load_config(CONFIGS / "legacy_aliases.json", world_size=2)
    zero = cfg.zero_optimization
    assert cfg.bf16.enabled                                               # "bfloat16"
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory   # cpu_offload
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory           # cpu_offload_params
    assert zero.stage3_gather_16bit_weights_on_model_save                 # ..._fp16_weights_...
    assert zero.load_from_fp32_weights and zero.ignore_unused_parameters and zero.elastic_checkpoint
    assert cfg.zero_allow_untested_optimizer
    assert cfg.monitor.csv.enabled and cfg.monitor.csv.output_path == "csv_logs/"        # csv_monitor
    assert cfg.checkpoint.tag_validation == "Ignore"
    dumped = cfg.to_dict()
    for gone in ("wandb", "amp", "comms_logger", "bfloat16", "csv_monitor", "data_types"):
        assert gone not in dumped


@pytest.mark.parametrize("old, new", [
    ({"cpu_offload_param": True}, "offload_param"),
    ({"cpu_offload_params": True}, "offload_param"),
    ({"cpu_offload": True}, "offload_optimizer"),
])
def test_cpu_offload_flags_without_pin_memory(old, new):
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3, **old}})
    block = getattr(cfg.zero_optimization, new)
    assert block.device == "cpu" and block.pin_memory is False


def test_cpu_offload_false_means_no_offload():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.zero_optimization.offload_optimizer is None


def test_pin_memory_flag_without_offload_is_an_error_when_true():
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 4, "zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}})
    assert info.value.key_path == "zero_optimization.cpu_offload_use_pin_memory"


@pytest.mark.parametrize("flag, stage", [(True, 1), (False, 0)])
def test_very_old_boolean_zero_optimization(flag, stage):
    assert load_config({"train_batch_size": 4, "zero_optimization": flag}).zero_stage == stage


def test_offload_device_none_is_no_offload_even_at_stage_0():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {
        "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}})
    assert cfg.zero_optimization.offload_optimizer is None and cfg.zero_optimization.offload_param is None


def test_switched_off_features_are_accepted_in_every_spelling():
    cfg = load_config({
        "train_batch_size": 4,
        "flops_profiler": {"enabled": False, "profile_step": 1, "detailed": True},
        "autotuning": {"enabled": False}, "elasticity": None, "pipeline": {},
        "compression_training": {}, "dump_state": False, "sparse_gradients": False,
        "zero_force_ds_cpu_optimizer": True, "aio": None,
        "amp": {"enabled": "auto", "opt_level": "auto"},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1, "mics_shard_size": -1,
                              "offload_optimizer": {"device": "cpu", "buffer_count": 4, "ratio": 1,
                                                    "pipeline_read": False},
                              "offload_param": {"device": "cpu", "buffer_size": 1e8, "nvme_path": None}},
        "checkpoint": {"parallel_write": {"pipeline_stage": False}, "checkpoint_serialization": True},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False},
    })
    assert cfg.zero_stage == 3


@pytest.mark.parametrize("config", [
    {"zero_force_ds_cpu_optimizer": "yes"},
    {"amp": {"enabled": True}},
    {"data_types": {"grad_accum_dtype": "fp32"}},
    {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}},
    {"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
    {"dump_state": 1},
    {"checkpoint": {"use_node_local_storage": True}},
])
def test_switched_on_features_are_errors(config):
    with pytest.raises(ConfigError, match="DeepSpeed feature zeroengine does not implement"):
        load_config({"train_batch_size": 4, **config})


def test_defaults():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    # DeepSpeed's default since 0.19.3 (PR #8068); an explicit 0 turns clipping off
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10 and not cfg.wall_clock_breakdown
    assert load_config({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0}).gradient_clipping == 0.0
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.zero_stage == 0 and cfg.zero_optimization.overlap_comm is False
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 100_000
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
            fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == \
        (False, False, 0.0, 16, 1000, 2, False, 1.0)
    assert cfg.checkpoint.tag_validation == "Warn"
    assert cfg.comm_debug is False and cfg.communication_data_type is None
    assert cfg.precision_dtype is torch.float32


@pytest.mark.parametrize("spelling, canonical", [("adam", "Adam"), ("ADAMW", "AdamW"), ("cpuadam", "CPUAdam"),
                                                 ("Sgd", "SGD")])
def test_optimizer_type_is_matched_case_insensitively(spelling, canonical):
    cfg = load_config({"train_batch_size": 4, "optimizer": {"type": spelling}})
    assert cfg.optimizer.type == canonical and cfg.optimizer.params == {}


def test_params_keep_only_the_keys_given():
    cfg = load_config({"train_batch_size": 4,
                       "optimizer": {"type": "CPUAdam", "params": {"lr": 3e-4, "adamw_mode": False}},
                       "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": [1e-3]}}})
    assert cfg.optimizer.params == {"lr": 3e-4, "adamw_mode": False}
    assert cfg.scheduler.params == {"cycle_min_lr": 1e-5, "cycle_max_lr": [1e-3]}


def test_warmup_max_lr_auto_follows_the_optimizer_lr():
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}
    assert load_config(config).scheduler.params["warmup_max_lr"] == 3e-4
    del config["optimizer"]            # a client optimizer: each param group's own lr
    assert load_config(config).scheduler.params["warmup_max_lr"] is None


def test_dict_source_is_not_modified():
    config = {"train_batch_size": "auto", "bfloat16": {"enabled": True},
              "zero_optimization": {"stage": 2, "cpu_offload": True, "reduce_bucket_size": "auto"},
              "flops_profiler": {"enabled": False}}
    before = copy.deepcopy(config)
    load_config(config, world_size=2, hidden_size=64)
    assert config == before


def test_to_dict_is_json_and_loads_back_equal():
    cfg = load_config(CONFIGS / "hf_ds_config_zero3.json", world_size=2, hidden_size=512)
    data = json.loads(json.dumps(cfg.to_dict()))
    again = load_config(data, world_size=2)
    assert again.to_dict() == cfg.to_dict()


def test_reloading_a_config_object_keeps_its_hidden_size():
    cfg = load_config(CONFIGS / "hf_ds_config_zero3.json", world_size=2, hidden_size=256)
    again = load_config(cfg, world_size=4)
    assert again.zero_optimization.reduce_bucket_size == 256 * 256
    assert again.train_batch_size == 16                 # micro 4 * world 4
    other = load_config(cfg, world_size=4, hidden_size=128)
    assert other.zero_optimization.reduce_bucket_size == 128 * 128


def test_directly_constructed_config_can_be_resolved():
    cfg = ZeroEngineConfig(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": 1})
    resolved = load_config(cfg, world_size=3)
    assert (resolved.train_batch_size, resolved.gradient_accumulation_steps, resolved.zero_stage) == (6, 1, 1)


def test_public_names_are_reexported():
    import zeroengine
    import zeroengine.config as config
    assert zeroengine.ConfigError is config.ConfigError
    assert {"load_config", "ZeroEngineConfig", "ConfigError"} <= set(config.__all__)


def test_auto_with_a_fixed_default_warns_and_names_the_key(caplog):
    from zeroengine.config import build_config

    with caplog.at_level("WARNING", logger="zeroengine.config.auto"):
        cfg = build_config({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto",
                                                                        "warmup_num_steps": "auto"}}})
    assert cfg.optimizer.params["lr"] == 1e-3
    assert 'optimizer.params.lr "auto" -> 0.001' in caplog.text
    assert 'scheduler.params.warmup_num_steps "auto" -> 0' in caplog.text
    assert "warmup_max_lr" not in caplog.text  # derived from the optimizer's lr: nothing to warn about


@pytest.mark.parametrize("value", [True, False])
def test_zero_force_ds_cpu_optimizer_loads_at_either_value(value):
    # false is what DeepSpeed configs write to allow a client optimizer with offload, which zeroengine supports
    cfg = load_config({"train_batch_size": 4, "zero_force_ds_cpu_optimizer": value,
                       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.zero_stage == 2


def test_a_config_object_changed_after_loading_is_refused_by_key_path():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 1}})
    assert load_config(cfg, world_size=2).train_micro_batch_size_per_gpu == 2  # unchanged: re-resolved
    cfg.zero_optimization.stage = 2
    with pytest.raises(ConfigError, match="zero_optimization.stage: this config object was changed"):
        load_config(cfg, world_size=2)


@pytest.mark.parametrize("value", [None, 0])
def test_steps_per_print_null_or_zero_means_never_as_deepspeeds_default(value):
    assert not load_config({"train_batch_size": 4, "steps_per_print": value}).steps_per_print


def test_top_level_csv_monitor_next_to_a_null_monitor_section_loads():
    cfg = load_config({"train_batch_size": 4, "monitor": None,
                       "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "j"}})
    assert cfg.monitor.csv.enabled and cfg.monitor.csv.job_name == "j"
