"""``deepspeed.runtime.dataloader``: ``RepeatingLoader``, where DeepSpeed defines it."""
from zeroengine.data import RepeatingLoader  # noqa: F401
