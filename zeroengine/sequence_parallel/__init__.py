"""zeroengine.sequence_parallel: Ulysses sequence parallelism (DeepSpeed's names under
``deepspeed.runtime.sequence_parallel``).

Each rank of a sequence group holds 1/sp of every sequence; around attention the group switches to 1/sp of the
heads (:mod:`.all_to_all`). For Hugging Face models: :class:`UlyssesSPAttentionHF`'s
``register_with_transformers`` (returns the mpu for ``initialize``), :class:`UlyssesSPDataLoaderAdapter` for the
data, and :func:`sequence_parallel_loss` for the loss. Tiled compute (:mod:`.tiled`: :class:`TiledMLP`,
:func:`sequence_tiled_compute`, :class:`TiledFusedLogitsLoss`) runs per-token work one piece of the sequence at a
time. See docs/long-context.md.
"""
from . import parallel_state
from .all_to_all import heads_to_sequence, sequence_to_heads
from .data import UlyssesSPDataLoaderAdapter, move_to_device, shift_labels
from .distributed_attention import DistributedAttention, seq_all_to_all
from .loss import gather_scalars, sequence_parallel_loss
from .tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute, shards_for
from .ulysses_hf import UlyssesSPAttentionHF

__all__ = ["DistributedAttention", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "gather_scalars", "heads_to_sequence", "move_to_device", "parallel_state",
           "seq_all_to_all", "sequence_parallel_loss", "sequence_tiled_compute", "sequence_to_heads", "shards_for",
           "shift_labels"]
