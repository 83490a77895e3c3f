"""zeroengine: a ZeRO-style, memory-optimizing training engine for PyTorch.

Public API only; see DESIGN.md for the contract.
"""
from zeroengine.comm import init_distributed
from zeroengine.config import ConfigError
from zeroengine.engine import Engine
from zeroengine.initialize import add_config_arguments, initialize

__version__ = "0.1.0"

__all__ = ["ConfigError", "Engine", "add_config_arguments", "init_distributed", "initialize", "__version__"]
