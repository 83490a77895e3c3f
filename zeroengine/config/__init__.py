"""zeroengine's configuration: DeepSpeed-compatible keys, strictly validated.

    from zeroengine.config import load_config
    cfg = load_config("ds_config.json", world_size=4, hidden_size=model_dim)
    cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu, cfg.precision_dtype

Every key, type and default is listed in docs/config-reference.md, generated
by ``python -m zeroengine.config.docs`` from the models in ``sections/``.
"""
from .errors import ConfigError, Problem
from .loader import build_config, load_config, read_config_file
from .root import ZeroEngineConfig

__all__ = ["ConfigError", "Problem", "ZeroEngineConfig", "build_config", "load_config", "read_config_file"]
