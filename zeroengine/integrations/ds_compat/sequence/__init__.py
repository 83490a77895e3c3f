"""``deepspeed.sequence``: Megatron-DeepSpeed's Ulysses layer."""
from . import layer  # noqa: F401
