"""Configs the integrations write themselves load: the Hugging Face docs' ZeRO-2/ZeRO-3 templates, axolotl's
(sub_group_size 0), Lightning's offload preset (as pytorch-lightning 2.6.6's DeepSpeedStrategy writes it:
aio with thread_count, NVMe buffer keys beside device "cpu"), accelerate's steps_per_print = inf."""
import json
import logging

import pytest
from runner import config

from zeroengine.config import ConfigError, load_config


@pytest.mark.parametrize("name, stage", [("hf_zero2.json", 2), ("hf_zero3.json", 3), ("axolotl_zero3_bf16.json", 3),
                                         ("lightning_stage_3_offload.json", 3)])
def test_configs_the_tools_write_load(name, stage):
    cfg = load_config(config(name), world_size=2, hidden_size=64)
    assert cfg.zero_optimization.stage == stage


def test_nvme_keys_beside_a_cpu_device_are_inert_and_say_so(caplog):
    with open(config("lightning_stage_3_offload.json")) as f:
        data = json.load(f)
    with caplog.at_level(logging.INFO, logger="zeroengine"):
        cfg = load_config(data)
    assert cfg.zero_optimization.offload_param.device == "cpu"
    lines = [r.getMessage() for r in caplog.records if "NVMe offload" in r.getMessage()]
    assert len(lines) == 2 and "offload_param.{nvme_path, buffer_count, buffer_size, max_in_cpu} ignored" in lines[1]
    # with device "nvme" the same keys configure the swap (Lightning's preset: nvme_path "/local_nvme")
    data["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    nvme = load_config(data).zero_optimization.offload_optimizer
    assert nvme.nvme_path == "/local_nvme" and nvme.buffer_count == 4 and nvme.aio.thread_count == 1
    data["zero_optimization"]["offload_param"]["device"] = "nvme"
    param = load_config(data).zero_optimization.offload_param
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 100_000_000, 1_000_000_000)
    del data["zero_optimization"]["offload_param"]["nvme_path"]
    with pytest.raises(ConfigError, match="zero_optimization.offload_param.nvme_path: device 'nvme' needs"):
        load_config(data)


@pytest.mark.parametrize("value", [float("inf"), "Infinity"])
def test_steps_per_print_infinity_means_never(tmp_path, value):
    if isinstance(value, str):  # JSON's spelling, in a file
        path = tmp_path / "c.json"
        path.write_text('{"train_batch_size": 2, "steps_per_print": Infinity}')
        cfg = load_config(str(path))
    else:
        cfg = load_config({"train_batch_size": 2, "steps_per_print": value})
    assert cfg.steps_per_print is None


def test_sub_group_size_zero_loads_and_a_negative_one_does_not():
    assert load_config({"train_batch_size": 2, "zero_optimization": {"sub_group_size": 0}})
    with pytest.raises(ConfigError, match="zero_optimization.sub_group_size"):
        load_config({"train_batch_size": 2, "zero_optimization": {"sub_group_size": -1}})
