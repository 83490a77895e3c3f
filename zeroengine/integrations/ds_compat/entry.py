"""``deepspeed.initialize`` and ``deepspeed.init_distributed`` with DeepSpeed's signatures."""
from __future__ import annotations

import zeroengine
from zeroengine import comm


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """DeepSpeed's ``initialize``: zeroengine's, plus the keywords only DeepSpeed has. ``distributed_port``
    is read only when this call starts the process group (as DeepSpeed); ``mesh_param`` (DeepSpeed's
    (data, sequence) parallel sizes) is refused: zeroengine builds its mesh from the config and the model."""
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=...) is not supported: zeroengine builds its process mesh itself, "
                         "from the config's tensor_parallel.autotp_size, a PipelineModule's stages, or an mpu "
                         "passed to initialize (the data-parallel size is what remains); leave mesh_param None")
    if distributed_port is not None and dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    return zeroengine.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                 training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                 dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                 config_params=config_params)


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=None, verbose=True, timeout=None,
                     init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    """DeepSpeed's ``init_distributed``, in DeepSpeed's positional order, over
    :func:`zeroengine.comm.init_distributed` (which takes the same keywords; see there)."""
    comm.init_distributed(dist_backend=dist_backend, auto_mpi_discovery=auto_mpi_discovery,
                          distributed_port=distributed_port, verbose=verbose, timeout=timeout, init_method=init_method,
                          dist_init_required=dist_init_required, config=config, rank=rank, world_size=world_size)
