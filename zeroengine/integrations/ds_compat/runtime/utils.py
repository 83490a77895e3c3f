"""``deepspeed.runtime.utils``: ``move_to_device`` (the sequence-parallel tutorial's)."""
from zeroengine.sequence_parallel import move_to_device  # noqa: F401
