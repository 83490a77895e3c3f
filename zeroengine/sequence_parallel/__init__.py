"""zeroengine.sequence_parallel: Ulysses sequence parallelism (DeepSpeed's names under
``deepspeed.runtime.sequence_parallel``).

Each rank of a sequence group holds 1/sp of every sequence; around attention the group switches to 1/sp of the
heads (:mod:`.all_to_all`). For Hugging Face models: :class:`UlyssesSPAttentionHF`'s
``register_with_transformers`` (returns the mpu for ``initialize``), :class:`UlyssesSPDataLoaderAdapter` for the
data, and :func:`sequence_parallel_loss` for the loss; see docs/long-context.md.
"""
from . import parallel_state
from .all_to_all import heads_to_sequence, sequence_to_heads
from .data import UlyssesSPDataLoaderAdapter, move_to_device, shift_labels
from .distributed_attention import DistributedAttention, seq_all_to_all
from .loss import gather_scalars, sequence_parallel_loss
from .ulysses_hf import UlyssesSPAttentionHF

__all__ = ["DistributedAttention", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "gather_scalars", "heads_to_sequence",
           "move_to_device", "parallel_state", "seq_all_to_all", "sequence_parallel_loss", "sequence_to_heads", "shift_labels"]
