"""The ``deepspeed`` package as transformers, accelerate and DeepSpeed-style scripts import it, made of
zeroengine's own objects. With ``ZEROENGINE_AS_DEEPSPEED=1`` this package *is* ``deepspeed``
(:mod:`zeroengine.integrations.as_deepspeed`); each submodule mirrors one DeepSpeed module path, so that
``from deepspeed.runtime.engine import DeepSpeedEngine`` finds the zeroengine engine.

Only names the integrations reach are here, each the real zeroengine object or an equivalent documented
in docs/integrations.md; anything else is an ImportError / AttributeError, never a stub.
"""
from zeroengine.engine import Engine as DeepSpeedEngine
from zeroengine.initialization import add_config_arguments
from zeroengine.integrations.as_deepspeed import DEEPSPEED_VERSION as __version__

from . import accelerator, checkpoint, comm, moe, ops, pipe, runtime, utils, zero  # noqa: F401 (DeepSpeed's attributes)
from .entry import init_distributed, initialize
from .pipe import PipelineModule
from .runtime.activation_checkpointing import checkpointing  # noqa: F401 (deepspeed.checkpointing)
from .runtime.pipe import PipelineEngine

__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split("."))
__git_hash__ = None
__git_branch__ = None

__all__ = ["DeepSpeedEngine", "PipelineEngine", "PipelineModule", "add_config_arguments", "init_distributed",
           "initialize", "__version__"]
