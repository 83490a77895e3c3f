"""Tensor-parallel layers: a linear layer's matrix, or an embedding's vocabulary, split across the tensor group.

Every split parameter carries a :class:`TensorSplit` (``param._ze_tp_split``): along which dimension of the
*original* layout it was cut, into how many parts, and in how many blocks (a fused query-key-value matrix is
three blocks, each cut by heads, so that each rank keeps whole heads of all three). That is what lets a
checkpoint saved at one tensor-parallel size load at another, and what ``ze_to_fp32`` merges back into the
model's own tensors. Parameters without one (layer norms, a row-parallel layer's bias) are replicated:
every tensor rank holds, and computes the same gradient for, all of them.

The layers keep the wrapped module's parameter names (``weight``, ``bias``) and layout (a GPT-2 ``Conv1D``
stores its weight input-major), so the model's state_dict names do not change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroengine import comm

from .ops import TensorGroup, copy_to, gather_from, reduce_from


@dataclass(frozen=True)
class TensorSplit:
    dim: int  # of the original (full) tensor
    parts: int
    rank: int
    blocks: int = 1  # the dimension is made of this many equal blocks, each cut into ``parts``
    full_shape: tuple = ()

    def shard(self, full: torch.Tensor, parts: int | None = None, rank: int | None = None) -> torch.Tensor:
        """This split's piece of ``full`` (or another ``parts`` / ``rank``'s)."""
        parts = self.parts if parts is None else parts
        rank = self.rank if rank is None else rank
        blocks = full.chunk(self.blocks, dim=self.dim)
        return torch.cat([b.chunk(parts, dim=self.dim)[rank] for b in blocks], dim=self.dim).contiguous()

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in rank order."""
        per_rank = [s.chunk(self.blocks, dim=self.dim) for s in shards]
        return torch.cat([torch.cat([r[b] for r in per_rank], dim=self.dim) for b in range(self.blocks)],
                         dim=self.dim)

    def as_dict(self) -> dict:
        return {"dim": self.dim, "parts": self.parts, "rank": self.rank, "blocks": self.blocks,
                "full_shape": list(self.full_shape)}

    @staticmethod
    def from_dict(d: dict) -> "TensorSplit":
        return TensorSplit(d["dim"], d["parts"], d["rank"], d["blocks"], tuple(d["full_shape"]))


def split_of(p: torch.Tensor) -> TensorSplit | None:
    return getattr(p, "_ze_tp_split", None)


def split_param(full: torch.Tensor, dim: int, tg: TensorGroup, blocks: int = 1) -> torch.nn.Parameter:
    parts, rank = tg.size, tg.rank
    if full.shape[dim] % (parts * blocks):
        raise ValueError(f"a dimension of size {full.shape[dim]} cannot be split into {parts} tensor-parallel parts"
                         + (f" of {blocks} blocks" if blocks > 1 else ""))
    split = TensorSplit(dim, parts, rank, blocks, tuple(full.shape))
    p = torch.nn.Parameter(split.shard(full.detach()), requires_grad=full.requires_grad)
    p._ze_tp_split = split
    return p


class ParallelLinear(torch.nn.Module):
    """A linear map with its weight split by output features (``style="column"``) or input features
    (``"row"``). ``input_major``: the weight is stored [in, out] (GPT-2's Conv1D) rather than [out, in].

    Column: the input is whole on every rank, the output is this rank's features (``gather_output`` makes it
    whole again); ``input_copied``: the caller applied :func:`copy_to` to the input once for several layers
    reading it (Llama's q, k and v), so its gradient is all-reduced once, not once per layer. Row: the input is this rank's features (a column-parallel output), the partial products are
    summed over the group, then the (replicated) bias is added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, style: str, group, input_major: bool = False,
                 gather_output: bool = False, blocks: int = 1, input_copied: bool = False):
        super().__init__()
        if style not in ("column", "row"):
            raise ValueError(f"style must be 'column' or 'row', got {style!r}")
        group = _group(group)
        self.style, self.group, self.input_major, self.gather_output = style, group, input_major, gather_output
        # column: the input went through copy_to already (one all-reduce in backward for the layers sharing it)
        self.input_copied = input_copied
        out_dim = 1 if input_major else 0
        split_dim = out_dim if style == "column" else 1 - out_dim
        self.weight = split_param(weight, split_dim, group, blocks)
        if bias is None:
            self.bias = None
        elif style == "column":
            self.bias = split_param(bias, 0, group, blocks)
        else:
            self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def forward(self, x):
        if self.style == "column" and not self.input_copied:
            x = copy_to(x, self.group)
        y = x @ self.weight if self.input_major else F.linear(x, self.weight)
        if self.style == "row":
            y = reduce_from(y, self.group)
            return y if self.bias is None else y + self.bias
        if self.bias is not None:
            y = y + self.bias
        return gather_from(y, self.group) if self.gather_output else y


class ColumnParallelLinear(ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with its output features split across the tensor group (``group``:
    a process group or TensorGroup; None: see zeroengine.parallel.mesh.current_mesh)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None):
        full = torch.nn.Linear(in_features, out_features, bias=bias)
        super().__init__(full.weight, full.bias, "column", _group(group), gather_output=gather_output)


class RowParallelLinear(ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with its input features split (its input: a column-parallel
    layer's output)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None):
        full = torch.nn.Linear(in_features, out_features, bias=bias)
        super().__init__(full.weight, full.bias, "row", _group(group))


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows (the vocabulary) are split across the tensor group: each rank looks up the
    tokens in its range, zeros elsewhere, and the sum over the group is the full lookup."""

    def __init__(self, weight: torch.Tensor, group, padding_idx: int | None = None):
        super().__init__()
        group = self.group = _group(group)
        self.weight = split_param(weight, 0, group)
        rows = self.weight.shape[0]
        self.start = self.weight._ze_tp_split.rank * rows
        self.end = self.start + rows
        self.padding_idx = padding_idx - self.start if padding_idx is not None and \
            self.start <= padding_idx < self.end else None

    @classmethod
    def of(cls, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, group=None):
        full = torch.nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        return cls(full.weight, _group(group), padding_idx)

    def as_head(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding used as the output projection (tied LM head): this rank's vocabulary slice of the
        logits, for :func:`vocab_parallel_cross_entropy`."""
        return F.linear(copy_to(x, self.group), self.weight)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross-entropy over logits whose last dimension (the vocabulary) is split across the group:
    three all-reduces of one number per token (the max, the sum of exponentials, the target's logit) instead
    of gathering the logits."""

    @staticmethod
    def forward(ctx, logits, target, tg):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        comm.all_reduce(local_max, op=comm.ReduceOp.MAX, group=tg.group)
        shifted = logits - local_max.unsqueeze(-1)
        vocab = logits.shape[-1]
        start = tg.rank * vocab
        outside = (target < start) | (target >= start + vocab)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group=tg.group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group=tg.group)
        loss = sum_exp.log() - target_logit
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).to(grad_logits.dtype)
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (vocabulary split across the tensor group, as a column-parallel LM head
    leaves them) against ``target``, over the targets that are not ``ignore_index``."""
    tg = _group(group)
    if tg.size == 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                               ignore_index=ignore_index)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    keep = flat_target != ignore_index
    losses = _VocabParallelCrossEntropy.apply(flat_logits, flat_target.masked_fill(~keep, 0), tg)
    return (losses * keep).sum() / keep.sum().clamp(min=1)


def _group(group) -> TensorGroup:
    """The tensor group: the one given, else that of :func:`zeroengine.parallel.mesh.current_mesh` (the mesh of an
    enclosing ``use_mesh``, else this world's tensor-parallel mesh)."""
    if group is not None:
        return TensorGroup.of(group)
    from zeroengine.parallel.mesh import current_mesh

    return current_mesh().tensor_group
