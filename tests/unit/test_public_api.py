"""The public names (the project's design contract fixes them) are importable and are what they claim to be."""
import argparse
import inspect

import zeroengine


def test_top_level_names():
    import zeroengine.initialization  # importing the module must not shadow the function

    assert callable(zeroengine.initialize) and inspect.isfunction(zeroengine.initialize)
    params = list(inspect.signature(zeroengine.initialize).parameters)
    for name in ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "config",
                 "collate_fn", "dist_init_required"):
        assert name in params
    assert issubclass(zeroengine.ConfigError, Exception)
    assert callable(zeroengine.init_distributed)


def test_add_config_arguments_accepts_deepspeed_spellings():
    for flag in ("--zeroengine_config", "--deepspeed_config"):
        parser = zeroengine.add_config_arguments(argparse.ArgumentParser())
        args = parser.parse_args([flag, "ds.json", "--deepspeed"])
        assert args.zeroengine_config == "ds.json" and args.zeroengine


def test_engine_exposes_the_deepspeed_accessors():
    for name in ("backward", "step", "is_gradient_accumulation_boundary", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps", "train", "eval", "get_lr", "memory_breakdown", "zero_stage"):
        assert hasattr(zeroengine.Engine, name), name
