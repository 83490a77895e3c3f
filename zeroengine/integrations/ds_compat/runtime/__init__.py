"""``deepspeed.runtime``: the engine, ZeRO, schedules, the optimizer base and the data loader helpers under
DeepSpeed's paths."""
from . import base_optimizer, dataloader, engine, lr_schedules, zero  # noqa: F401
