"""zeroengine.pipe: pipeline parallelism (DeepSpeed's ``deepspeed.pipe`` names).

Build the model as a :class:`PipelineModule` of layers (:class:`LayerSpec` to build each layer only on its
stage, :class:`TiedLayerSpec` for weights several stages share), pass it to ``zeroengine.initialize``, and
train with ``engine.train_batch(data_iter)``; see docs/parallelism.md.
"""
from .module import PipelineModule
from .spec import LayerSpec, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
