"""``deepspeed.checkpointing``: the same module as ``deepspeed.runtime.activation_checkpointing.checkpointing``
(as in DeepSpeed), so that ``import deepspeed.checkpointing`` finds it too."""
import sys

from .runtime.activation_checkpointing import checkpointing

sys.modules[__name__] = checkpointing
