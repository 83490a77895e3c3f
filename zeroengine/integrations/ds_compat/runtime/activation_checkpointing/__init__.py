"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` (zeroengine.checkpointing) and
``offload_activations`` (the checkpointed hidden states to host memory)."""
from . import checkpointing, offload_activations  # noqa: F401
