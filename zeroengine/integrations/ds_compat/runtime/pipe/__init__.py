"""``deepspeed.runtime.pipe``: the pipeline module (and its engine, which ``initialize`` builds for it)."""
from zeroengine.pipe.engine import PipelineEngine  # noqa: F401

from . import module  # noqa: F401
from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "TiedLayerSpec"]
