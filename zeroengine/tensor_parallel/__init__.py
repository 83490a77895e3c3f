"""zeroengine.tensor_parallel: Megatron-style tensor parallelism (layers split across the mesh's tensor group).

``tensor_parallel.autotp_size`` in the config splits a Hugging Face model's layers at initialize (AutoTP);
models of one's own use :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
:class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy` directly. See docs/parallelism.md.
"""
from .layers import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    TensorSplit,
    VocabParallelEmbedding,
    split_of,
    vocab_parallel_cross_entropy,
)
from .ops import TensorGroup, copy_to, gather_from, reduce_from, scatter_to

__all__ = ["ColumnParallelLinear", "ParallelLinear", "RowParallelLinear", "TensorGroup", "TensorSplit",
           "VocabParallelEmbedding", "copy_to", "gather_from", "reduce_from", "scatter_to", "split_of",
           "vocab_parallel_cross_entropy"]
