"""List every config key the installed DeepSpeed reads, with its default, as JSON.

Used to (re)generate tests/unit/configs/deepspeed_0_19_8_keys.json, which
tests/unit/test_config_deepspeed_keys.py loads into zeroengine key by key: no
key a DeepSpeed config may hold may be an "unknown key" here. Run it by hand
(DeepSpeed installed, no GPU needed); the package itself never imports DeepSpeed:

    DS_ACCELERATOR=cpu python scripts/list_deepspeed_keys.py > tests/unit/configs/deepspeed_0_19_8_keys.json

Two sources, because DeepSpeed reads its config two ways:

* the dict parsers (``get_scalar_param`` and friends in runtime/config.py and
  the feature configs it calls) are observed by running ``DeepSpeedConfig``
  on a dict that records every key looked up and the default offered for it,
  once with each section present (so nested parsers run too);
* the pydantic sections (``zero_optimization``, the offload blocks, ``fp16``,
  ``bf16``, the monitors, ``compile``, ``tensor_parallel``, ...) are listed
  from their model fields, aliases and Python names both (DeepSpeed's models
  populate by name).
"""
from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Keys read without a default (only tested with ``in``), or whose recorded default is not the
# value a user would write: DeepSpeed's effective default, or SKIP for keys not listed.
SKIP = object()
_NO_DEFAULT = object()  # a key looked up without a default (``in``, ``[]``): a section
OVERRIDES = {
    ("", "train_batch_size"): SKIP,  # the batch triangle has its own tests
    ("", "train_micro_batch_size_per_gpu"): SKIP,
    ("", "gradient_accumulation_steps"): SKIP,
    ("", "steps_per_print"): SKIP,  # DeepSpeed's None (never print) is not a value a config holds
    ("", "optimizer"): SKIP,  # needs a type; its params depend on the type
    ("", "scheduler"): SKIP,
    ("optimizer", "type"): SKIP,
    ("scheduler", "type"): SKIP,
    ("scheduler", "params"): SKIP,
    ("optimizer", "legacy_fusion"): False,
    ("", "bf16"): {},
    ("", "zero_optimization"): {},
    ("zero_optimization", "mics_shard_size"): -1,
    ("zero_optimization", "mics_hierarchical_params_gather"): False,
    ("zero_optimization", "zeropp_loco_param"): None,
    ("torch_autocast", "dtype"): None,
    ("torch_autocast", "lower_precision_safe_modules"): None,
    ("data_efficiency.data_sampling.dynamic_batching", "max_batch_size"): None,
}


class _Recorder(dict):
    """A config dict that records (section path, key, default offered) for every lookup."""

    seen: dict = {}

    def __init__(self, path, *args):
        super().__init__(*args)
        self._path = path

    def _note(self, key, default=_NO_DEFAULT):
        if isinstance(key, str) and self.seen.get((self._path, key), _NO_DEFAULT) is _NO_DEFAULT:
            self.seen[(self._path, key)] = default

    def _child(self, key, value):
        if type(value) is dict:
            value = _Recorder(f"{self._path}.{key}" if self._path else key, value)
            dict.__setitem__(self, key, value)
        return value

    def get(self, key, default=None):
        self._note(key, default)
        return self._child(key, dict.__getitem__(self, key)) if dict.__contains__(self, key) else default

    def __getitem__(self, key):
        self._note(key)
        return self._child(key, dict.__getitem__(self, key))

    def __contains__(self, key):
        self._note(key)
        return dict.__contains__(self, key)

    def keys(self):
        outer = self

        class _Keys(list):
            def __contains__(self, key):
                outer._note(key)
                return list.__contains__(self, key)

        return _Keys(dict.keys(self))

    def __copy__(self):
        return _Recorder(self._path, dict(self))


def _parse(config):
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        DeepSpeedConfig(_Recorder("", {"train_batch_size": 1, **config}))
    except Exception:  # noqa: BLE001 - a section given as {} may be refused; its lookups are recorded anyway
        pass


def _nested(path: str, leaf) -> dict:
    out = cur = {}
    parts = path.split(".") if path else []
    for part in parts:
        cur[part] = {}
        cur = cur[part]
    if leaf is not None:
        cur[leaf] = {}
    return out


def dict_parsed_keys() -> dict:
    _parse({})
    for _ in range(3):  # each round opens one more level of sections
        for path, key in sorted(_Recorder.seen):
            _parse(_nested(path, key))
    return dict(_Recorder.seen)


def pydantic_keys() -> dict:
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPConfig, TPTrainingConfig
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    from pydantic_core import PydanticUndefined

    models = {
        "zero_optimization": DeepSpeedZeroConfig,
        "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
        "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
        "zero_optimization.leaf_module": DeepSpeedZeroLeafModuleConfig,
        "zero_optimization.zenflow": ZenFlowConfig,
        "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
        "csv_monitor": CSVConfig, "tensorboard": TensorBoardConfig, "wandb": WandbConfig, "comet": CometConfig,
        "comms_logger": CommsLoggerConfig, "compile": CompileConfig,
        "tensor_parallel": TPTrainingConfig, "tensor_parallel.tp": TPConfig,
        "timers.throughput": DeepSpeedThroughputTimerConfig,
        "weight_quantization": WeightQuantConfig, "hybrid_engine": HybridEngineConfig,
    }
    found = {}
    for path, model in models.items():
        for name, field in model.model_fields.items():
            if field.default is not PydanticUndefined:
                default = field.default
            elif field.default_factory is not None:
                default = field.default_factory()
            else:
                continue  # required: no default to try
            if hasattr(default, "model_dump"):
                default = default.model_dump()
            default = getattr(default, "value", default)  # enums
            try:
                json.dumps(default)
            except TypeError:
                continue  # a Python object (a torch dtype, a process group): never in a JSON config
            for spelling in {name, field.alias or name}:
                found[(path, spelling)] = default
    return found


def main() -> int:
    logging.disable(logging.WARNING)
    import deepspeed
    keys = {k: {} if v is _NO_DEFAULT else v for k, v in dict_parsed_keys().items()}
    keys.update(pydantic_keys())
    rows = []
    for (path, key), default in sorted(keys.items()):
        default = OVERRIDES.get((path, key), default)
        if default is SKIP:
            continue
        rows.append([path, key, default])
    # One key per line, so a diff between DeepSpeed versions reads key by key.
    lines = ",\n".join("  " + json.dumps(row) for row in rows)
    sys.stdout.write(f'{{"deepspeed": "{deepspeed.__version__}", "keys": [\n{lines}\n]}}\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
