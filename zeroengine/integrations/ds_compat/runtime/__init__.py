"""``deepspeed.runtime``: the engine, ZeRO, pipeline, schedules, the optimizer base and the data loader helpers
under DeepSpeed's paths."""
from . import activation_checkpointing, base_optimizer, dataloader, engine, lr_schedules, pipe, utils, zero  # noqa: F401
