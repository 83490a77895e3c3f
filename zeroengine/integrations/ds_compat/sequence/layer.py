"""``deepspeed.sequence.layer``: ``DistributedAttention`` (zeroengine.sequence_parallel's)."""
from zeroengine.sequence_parallel import DistributedAttention  # noqa: F401
