"""``deepspeed.runtime``: the engine, ZeRO, schedules and the optimizer base under DeepSpeed's paths."""
from . import base_optimizer, engine, lr_schedules, zero  # noqa: F401
