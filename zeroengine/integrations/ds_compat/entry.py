"""``deepspeed.initialize`` and ``deepspeed.init_distributed`` with DeepSpeed's signatures."""
from __future__ import annotations

from datetime import timedelta

import zeroengine
from zeroengine import comm


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """DeepSpeed's ``initialize``: zeroengine's, plus the keywords only DeepSpeed has. ``distributed_port``
    is read only when this call starts the process group (as DeepSpeed); ``mesh_param`` (a tensor/sequence
    parallel mesh) is refused."""
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=...) is not supported: zeroengine has no tensor or sequence "
                         "parallel mesh; leave it None")
    if distributed_port is not None and dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    return zeroengine.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                 training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                 dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                 config_params=config_params)


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=None, verbose=True, timeout=None,
                     init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    """DeepSpeed's ``init_distributed`` over :func:`zeroengine.comm.init_distributed`.

    The world comes from the launcher's variables (torchrun's, zeroengine's, accelerate's), or SLURM's or
    Open MPI's, which ``auto_mpi_discovery`` names; ``distributed_port`` is used when MASTER_PORT is not
    set; ``timeout`` (a timedelta or seconds) bounds every collective. ``init_method``, ``rank`` and
    ``world_size`` given explicitly are refused: zeroengine reads them from the environment."""
    if dist_init_required is False:
        return
    if init_method is not None or rank not in (-1, None) or world_size not in (-1, None):
        raise ValueError("init_distributed(init_method=/rank=/world_size=) is not supported: zeroengine reads "
                         "the world from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    import os

    if distributed_port is not None and "MASTER_PORT" not in os.environ and "RANK" in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    comm.init_distributed(backend=dist_backend, timeout_s=seconds)
