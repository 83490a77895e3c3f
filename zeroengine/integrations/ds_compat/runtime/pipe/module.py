"""``deepspeed.runtime.pipe.module``: zeroengine's :class:`~zeroengine.pipe.PipelineModule` taking DeepSpeed
0.19.8's arguments.

Two of them differ: ``dynamic_shape`` is accepted at either value (zeroengine sends every activation with its
shape, so shapes may change between micro-batches anyway), and ``topology`` is a
:class:`zeroengine.parallel.ProcessMesh`, not one of DeepSpeed's ``ProcessTopology`` objects (refused, saying
how to describe the same layout).
"""
from __future__ import annotations

from zeroengine import pipe
from zeroengine.parallel.mesh import ProcessMesh
from zeroengine.pipe import LayerSpec, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class PipelineModule(pipe.PipelineModule):
    """DeepSpeed's ``PipelineModule(layers, num_stages, topology, loss_fn, seed_layers, seed_fn, base_seed,
    partition_method, activation_checkpoint_interval, activation_checkpoint_func, checkpointable_layers,
    dynamic_shape)``, in that order; zeroengine's ``virtual_stages`` by keyword."""

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
                 base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
                 activation_checkpoint_func=None, checkpointable_layers=None, dynamic_shape=False, *,
                 virtual_stages: int = 1):
        if topology is not None and not isinstance(topology, ProcessMesh):
            raise TypeError(f"PipelineModule(topology=...): DeepSpeed's process topologies "
                            f"({type(topology).__name__}) are not supported: pass num_stages (pipeline stages; "
                            "the ranks are laid out pipe × data × tensor, as PipeModelDataParallelTopology does), "
                            "the tensor-parallel size as the config's tensor_parallel.autotp_size or an mpu to "
                            "initialize, or a zeroengine.parallel.ProcessMesh")
        del dynamic_shape  # every message carries its shape (zeroengine.pipe.link)
        super().__init__(layers, num_stages=num_stages, topology=topology, loss_fn=loss_fn,
                         seed_layers=seed_layers, seed_fn=seed_fn, base_seed=base_seed,
                         partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         activation_checkpoint_func=activation_checkpoint_func,
                         checkpointable_layers=checkpointable_layers, virtual_stages=virtual_stages)
