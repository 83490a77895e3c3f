"""Realistic config mistakes: each must raise ConfigError naming the key path (and the fix).

The table is the point of this file: every row is a mistake seen in real
DeepSpeed configs, and the assertion is on what the user reads.
"""
from pathlib import Path

import pytest
from pydantic import ValidationError

from zeroengine.config import ConfigError, ZeroEngineConfig, load_config

CONFIGS = Path(__file__).parent / "configs"
BASE = {"train_batch_size": 8}


def with_base(**sections):
    return {**BASE, **sections}


# (id, config, world_size, expected key_path, substrings the message must contain)
MISTAKES = [
    ("top-level typo", {"train_batch_szie": 8}, 1,
     "train_batch_szie", ["unknown key", "did you mean 'train_batch_size'?"]),
    ("nested typo", with_base(zero_optimization={"stage": 2, "overlap_com": True}), 1,
     "zero_optimization.overlap_com", ["did you mean 'overlap_comm'?"]),
    ("doubly nested typo", with_base(zero_optimization={"stage": 2, "offload_optimizer": {"devcie": "cpu"}}), 1,
     "zero_optimization.offload_optimizer.devcie", ["did you mean 'device'?"]),
    ("typo in a section name", with_base(zero_optimisation={"stage": 2}), 1,
     "zero_optimisation", ["did you mean 'zero_optimization'?"]),
    ("unknown key with no close match lists valid keys", with_base(fp16={"enabled": False, "xyz": 1}), 1,
     "fp16.xyz", ["unknown key", "valid keys here:", "loss_scale_window"]),
    ("stage as a word", with_base(zero_optimization={"stage": "two"}), 1,
     "zero_optimization.stage", ["expected an integer", "'two'"]),
    ("stage 4", with_base(zero_optimization={"stage": 4}), 1,
     "zero_optimization.stage", ["must be 0, 1, 2 or 3", "got 4"]),
    ("stage -1", with_base(zero_optimization={"stage": -1}), 1,
     "zero_optimization.stage", ["must be 0, 1, 2 or 3"]),
    ("boolean as a string", with_base(fp16={"enabled": "yes"}), 1,
     "fp16.enabled", ["expected true or false", "'yes'"]),
    ("boolean as a quoted true", with_base(wall_clock_breakdown="true"), 1,
     "wall_clock_breakdown", ["expected true or false"]),
    ("number as a string", with_base(gradient_clipping="1.0"), 1,
     "gradient_clipping", ["expected a number"]),
    ("section as a boolean", with_base(fp16=True), 1,
     "fp16", ["expected an object", "got true"]),
    ("batch triangle mismatch", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 2}, 2,
     "train_batch_size", ["train_batch_size (32)", "(4)", "(2)", "world size (2)", "= 16"]),
    ("batch not divisible", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1,
     "train_batch_size", ["not divisible", "gradient_accumulation_steps cannot be derived"]),
    ("batch not divisible by the world", {"train_batch_size": 9}, 2,
     "train_batch_size", ["not divisible by the world size (2)"]),
    ("no batch size", {"gradient_accumulation_steps": 4}, 1,
     "train_batch_size", ["set train_batch_size or train_micro_batch_size_per_gpu"]),
    ("non-positive batch size", {"train_batch_size": 0}, 1,
     "train_batch_size", ["must be > 0"]),
    ("negative micro batch", {"train_micro_batch_size_per_gpu": -2}, 1,
     "train_micro_batch_size_per_gpu", ["must be > 0"]),
    ("fp16 and bf16", with_base(fp16={"enabled": True}, bf16={"enabled": True}), 1,
     "fp16.enabled", ["fp16.enabled", "bf16.enabled", "at most one"]),
    ("fp16 and the old bfloat16", with_base(fp16={"enabled": True}, bfloat16={"enabled": True}), 1,
     "fp16.enabled", ["bf16.enabled"]),
    ("unknown optimizer type", with_base(optimizer={"type": "Adamm", "params": {"lr": 1e-3}}), 1,
     "optimizer.type", ["unknown optimizer type 'Adamm'", "did you mean 'Adam'?", "Adam, AdamW, SGD, CPUAdam"]),
    ("unimplemented optimizer", with_base(optimizer={"type": "OneBitAdam"}), 1,
     "optimizer.type", ["valid types: Adam, AdamW, SGD, CPUAdam"]),
    ("unknown optimizer param", with_base(optimizer={"type": "AdamW", "params": {"weight_decy": 0.1}}), 1,
     "optimizer.params.weight_decy", ["did you mean 'weight_decay'?"]),
    ("param of another optimizer", with_base(optimizer={"type": "SGD", "params": {"betas": [0.9, 0.99]}}), 1,
     "optimizer.params.betas", ["unknown key"]),
    ("betas of the wrong length", with_base(optimizer={"type": "Adam", "params": {"betas": [0.9]}}), 1,
     "optimizer.params.betas", ["two numbers"]),
    ("max_grad_norm as optimizer param", with_base(optimizer={"type": "Adam", "params": {"max_grad_norm": 1}}), 1,
     "optimizer.params.max_grad_norm", ["gradient_clipping"]),
    ("unknown scheduler type", with_base(scheduler={"type": "WarmupCosine", "params": {}}), 1,
     "scheduler.type", ["unknown scheduler type", "did you mean 'WarmupCosineLR'?"]),
    ("unknown scheduler param", with_base(scheduler={"type": "WarmupLR", "params": {"warmup_max_lrr": 0.1}}), 1,
     "scheduler.params.warmup_max_lrr", ["did you mean 'warmup_max_lr'?"]),
    ("missing total_num_steps", with_base(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}),
     1, "scheduler.params.total_num_steps", ["required key is missing"]),
    ("total_num_steps auto", with_base(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}),
     1, "scheduler.params.total_num_steps", ["cannot be resolved outside a trainer"]),
    ("total shorter than default warmup", with_base(scheduler={"type": "WarmupCosineLR",
                                                               "params": {"total_num_steps": 500}}),
     1, "scheduler.params.total_num_steps", ["(1000, the default)"]),
    ("auto in a non-auto place", with_base(steps_per_print="auto"), 1,
     "steps_per_print", ["'auto' is not accepted"]),
    ("auto in a nested non-auto place", with_base(zero_optimization={"stage": "auto"}), 1,
     "zero_optimization.stage", ["'auto' is not accepted"]),
    ("offload_param at stage 2", with_base(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}), 1,
     "zero_optimization.offload_param", ["needs ZeRO stage 3", "stage is 2"]),
    ("offload_optimizer at stage 0", with_base(zero_optimization={"offload_optimizer": {"device": "cpu"}}), 1,
     "zero_optimization.offload_optimizer", ["stage 1, 2 or 3"]),
    ("offload device missing", with_base(zero_optimization={"stage": 2, "offload_optimizer": {"pin_memory": True}}),
     1, "zero_optimization.offload_optimizer.device", ["required key is missing"]),
    ("parameter offload to nvme without a path", with_base(zero_optimization={
        "stage": 3, "offload_param": {"device": "nvme"}}), 1, "zero_optimization.offload_param.nvme_path",
     ["device 'nvme' needs nvme_path"]),
    ("nvme without nvme_path", with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
     1, "zero_optimization.offload_optimizer.nvme_path", ["device 'nvme' needs nvme_path"]),
    ("nvme with the delayed update", with_base(zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/tmp", "delayed_update": True}}),
     1, "zero_optimization.offload_optimizer.delayed_update", ["not implemented", "device 'cpu'"]),
    ("GPUDirect Storage", with_base(aio={"use_gds": True}), 1, "aio.use_gds", ["GPUDirect Storage"]),
    ("two thread counts", with_base(aio={"thread_count": 2, "intra_op_parallelism": 4}), 1, "aio",
     ["two names for one setting"]),
    ("offload device typo", with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpuu"}}), 1,
     "zero_optimization.offload_optimizer.device", ["'cpu', 'nvme' or 'none'", "did you mean 'cpu'?"]),
    ("enabled unsupported feature", with_base(flops_profiler={"enabled": True, "profile_step": 1}), 1,
     "flops_profiler", ["'flops_profiler' is a DeepSpeed feature zeroengine does not implement",
                        "remove it or set enabled=false"]),
    ("unsupported boolean feature", with_base(sparse_gradients=True), 1,
     "sparse_gradients", ["does not implement", "set it to false"]),
    ("nested unsupported feature", with_base(zero_optimization={"stage": 3, "zero_quantized_weights": True}), 1,
     "zero_optimization.zero_quantized_weights", ["does not implement"]),
    ("legacy_stage1 true", with_base(zero_optimization={"stage": 1, "legacy_stage1": True}), 1,
     "zero_optimization.legacy_stage1", ["does not implement"]),
    ("allgather_partitions false", with_base(zero_optimization={"stage": 2, "allgather_partitions": False}), 1,
     "zero_optimization.allgather_partitions", ["not supported"]),
    ("load_from_fp32_weights false", with_base(zero_optimization={"stage": 2, "load_from_fp32_weights": False}), 1,
     "zero_optimization.load_from_fp32_weights", ["not supported", "fp32 master weights"]),
    ("ignore_unused_parameters false", with_base(zero_optimization={"stage": 2, "ignore_unused_parameters": False}),
     1, "zero_optimization.ignore_unused_parameters", ["not supported", "zero gradient"]),
    ("non-integral bucket size", with_base(zero_optimization={"stage": 2, "reduce_bucket_size": 5.5}), 1,
     "zero_optimization.reduce_bucket_size", ["whole number", "5.5"]),
    ("bucket size as a string", with_base(zero_optimization={"stage": 2, "reduce_bucket_size": "5e8"}), 1,
     "zero_optimization.reduce_bucket_size", ["expected an integer"]),
    ("negative gradient clipping", with_base(gradient_clipping=-1.0), 1,
     "gradient_clipping", [">= 0"]),
    ("infinite loss scale", with_base(fp16={"enabled": True, "loss_scale": float("inf")}), 1,
     "fp16.loss_scale", ["finite"]),
    ("dynamic loss scale starting under its floor", with_base(fp16={
        "enabled": True, "initial_scale_power": 0, "min_loss_scale": 4}), 1,
     "fp16.initial_scale_power", ["start at 2**initial_scale_power = 1", "min_loss_scale = 4"]),
    ("loss scale power past float32", with_base(fp16={"enabled": True, "initial_scale_power": 200}), 1,
     "fp16.initial_scale_power", ["<= 127"]),
    ("bad tag_validation", with_base(checkpoint={"tag_validation": "Strict"}), 1,
     "checkpoint.tag_validation", ["'Ignore', 'Warn' or 'Fail'"]),
    ("bad communication_data_type", with_base(communication_data_type="bfloat16"), 1,
     "communication_data_type", ["'fp32', 'fp16' or 'bf16'", "did you mean 'bf16'?"]),
    ("deprecated and current spelling together", with_base(zero_optimization={
        "stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
        "stage3_gather_16bit_weights_on_model_save": True}), 1,
     "zero_optimization.stage3_gather_16bit_weights_on_model_save", ["given twice", "deprecated"]),
    ("cpu_offload and offload_optimizer", with_base(zero_optimization={
        "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}), 1,
     "zero_optimization.offload_optimizer", ["given twice", "cpu_offload"]),
    ("cpu_offload not a boolean", with_base(zero_optimization={"stage": 2, "cpu_offload": "yes"}), 1,
     "zero_optimization.cpu_offload", ["expected true or false"]),
    ("contiguous checkpointing without partitioning", with_base(activation_checkpointing={
        "contiguous_memory_optimization": True, "number_checkpoints": 4}), 1,
     "activation_checkpointing.contiguous_memory_optimization", ["partition_activations"]),
    ("nesterov without momentum", with_base(optimizer={"type": "SGD", "params": {"nesterov": True}}), 1,
     "optimizer.params.nesterov", ["momentum > 0"]),
]


@pytest.mark.parametrize("config, world_size, key_path, expected",
                         [pytest.param(*row[1:], id=row[0]) for row in MISTAKES])
def test_mistake_is_reported_at_its_key_path(config, world_size, key_path, expected):
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    error = info.value
    assert error.key_path == key_path
    assert str(error).startswith(key_path + ":")
    for text in expected:
        assert text in str(error)


def test_several_problems_are_all_listed_unknown_keys_first():
    config = {"train_batch_size": 8, "zero_optimization": {"stage": "two", "overlap_com": True},
              "fp16": {"enabled": "yes"}}
    with pytest.raises(ConfigError) as info:
        load_config(config)
    paths = [p.key_path for p in info.value.problems]
    assert paths[0] == "zero_optimization.overlap_com"
    assert set(paths) == {"zero_optimization.overlap_com", "zero_optimization.stage", "fp16.enabled"}
    assert info.value.key_path == paths[0]
    assert all(any(line.startswith(p) for line in str(info.value).splitlines()) for p in paths)


def test_malformed_file_names_file_line_and_column():
    path = CONFIGS / "malformed.json"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "malformed.json" in message
    assert "line 4" in message and "column" in message


@pytest.mark.parametrize("typo", ["tru", "True"])
def test_a_typo_in_a_json_file_is_placed_where_it_is_not_at_the_end(tmp_path, typo):
    # hjson reads `tru` as an unquoted string running on and fails at the end of the file
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_batch_size": 8,\n  // a comment line\n  "fp16": {"enabled": %s},\n'
                    '  "steps_per_print": 1,\n  "gradient_clipping": 1.0\n}\n' % typo)
    with pytest.raises(ConfigError, match=f"{path.name}, line 4, column 23: malformed JSON: Expecting value"):
        load_config(path)


def test_comments_trailing_commas_and_comment_marks_in_strings_do_not_hide_a_typo(tmp_path):
    # hjson allows these; JSON's account of the file is taken with them blanked, not stopped at them
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_batch_size": 8, // inline comment\n  "x": {"p": "/data/*.bin", "q": "a*/b#c",},\n'
                    '  "fp16": {"enabled": tru},\n}\n')
    with pytest.raises(ConfigError, match=f"{path.name}, line 4, column 23: malformed JSON: Expecting value"):
        load_config(path)


def test_an_unclosed_comment_is_a_config_error_not_a_parser_crash(tmp_path):
    # hjson itself fails with an IndexError here
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_batch_size": 8,\n  /* unclosed\n}\n')
    with pytest.raises(ConfigError, match=r"malformed JSON/HJSON: .*\(a /\* comment is never closed\)"):
        load_config(path)


def test_an_hjson_file_keeps_hjson_s_account_first(tmp_path):
    path = tmp_path / "ds_config.hjson"
    path.write_text("{\n  train_batch_size: 8\n  fp16: {enabled: true\n}\n")  # one brace short
    with pytest.raises(ConfigError, match=r"line 5, column 1: malformed HJSON: .*\(read as strict JSON: line 2"):
        load_config(path)


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n// and another\n/* and\n a block */\n"])
def test_an_empty_config_file_says_so(tmp_path, text):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="ds_config.json is empty"):
        load_config(path)


def test_errors_from_a_file_name_the_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 5}}')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.key_path == "zero_optimization.stage"
    assert info.value.source == str(path)
    assert str(path) in str(info.value)


def test_duplicate_key_in_a_file_is_an_error(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match="'stage' appears twice"):
        load_config(path)


def test_missing_file_and_non_object_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(tmp_path / "list.json")


@pytest.mark.parametrize("source", [42, ["train_batch_size"], None, b"{}"])
def test_unsupported_source_types(source):
    with pytest.raises(ConfigError, match="path to a JSON/HJSON file, a dict or a ZeroEngineConfig"):
        load_config(source)


@pytest.mark.parametrize("kwargs", [{"world_size": 0}, {"world_size": 1.5}, {"world_size": True},
                                    {"hidden_size": 0}, {"hidden_size": "1024"}])
def test_bad_world_or_hidden_size(kwargs):
    with pytest.raises(ConfigError) as info:
        load_config(BASE, **kwargs)
    assert info.value.key_path == next(iter(kwargs))


def test_communication_data_type_in_any_case_as_deepspeed():
    assert load_config(dict(BASE, communication_data_type="FP16")).communication_data_type == "fp16"


def test_constructing_the_model_directly_also_raises_config_error():
    with pytest.raises(ConfigError) as info:
        ZeroEngineConfig(train_batch_size=8, zero_optimization={"stage": 2, "overlap_com": True})
    assert info.value.key_path == "zero_optimization.overlap_com"
    assert not isinstance(info.value, ValidationError)


def test_config_error_is_not_a_pydantic_error_and_chains_nothing():
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "fp16": {"enabled": "yes"}})
    assert not isinstance(info.value, ValidationError)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_config_error_survives_pickling_across_processes(tmp_path):
    import pickle
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "fp16": {"enabled": "yes", "typo": 1}})
    copy = pickle.loads(pickle.dumps(info.value.with_source("ds.json")))
    assert type(copy) is ConfigError
    assert copy.problems == info.value.problems and copy.source == "ds.json"
    assert str(copy).startswith("fp16.typo: unknown key")


@pytest.mark.parametrize("written,key_path", [
    ({"csv_monitor": {"enabled": True, "output_pth": "x"}}, "csv_monitor.output_pth"),
    ({"tensorboard": {"enabled": True, "job_nam": "x"}}, "tensorboard.job_nam"),
    ({"bfloat16": {"enabled": "maybe"}}, "bfloat16.enabled"),
    ({"monitor": {"csv": {"enabled": True, "output_pth": "x"}}}, "monitor.csv.output_pth"),
])
def test_a_mistake_inside_a_deprecated_block_is_named_as_written(written, key_path):
    # DeepSpeed's top-level csv_monitor / tensorboard / bfloat16 blocks are moved before validation; a
    # mistake inside one was named at the new place (monitor.csv.output_pth), not where the user wrote it.
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, **written}, world_size=1)
    assert info.value.key_path == key_path, str(info.value)
