"""``deepspeed.runtime.activation_checkpointing.offload_activations``: the checkpointed hidden states to host
memory (zeroengine.activation_checkpointing.offload_hidden)."""
from zeroengine.activation_checkpointing.offload_hidden import (  # noqa: F401
    CheckpointActivationOffloadStats,
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)
