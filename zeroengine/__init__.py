"""zeroengine: a ZeRO-style, memory-optimizing training engine for PyTorch.

Public API only (docs/getting-started.md; the layers behind it: docs/architecture.md). Names are imported on first
use, so ``python -m zeroengine.launcher.main`` (which needs none of them)
starts without importing torch and the engine.
"""
from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "zeroengine.config",
    "Engine": "zeroengine.engine",
    "add_config_arguments": "zeroengine.initialization",
    "estimate_memory": "zeroengine.estimate",
    "init_distributed": "zeroengine.comm",
    "initialize": "zeroengine.initialization",
}
_SUBMODULES = {"comm", "config", "ops", "testing", "zero", "optim", "precision", "launcher", "checkpointing", "checkpoint",
               "activation_checkpointing", "integrations", "moe"}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return import_module(f"zeroengine.{name}")
    raise AttributeError(f"module 'zeroengine' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
