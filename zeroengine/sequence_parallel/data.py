"""Feeding sequence-parallel ranks (DeepSpeed's ``UlyssesSPDataLoaderAdapter`` and ``move_to_device``).

Each rank of a sequence group reads its own batches, as under plain data parallelism; the group then trains on
them one after the other, together: the adapter gathers the group's batches and yields, for each of them, this
rank's piece of every sequence. So one pass of the wrapped loader gives sp times its length in micro-batches,
each holding 1/sp of a sequence.

Labels are shifted before they are cut (``shift_labels``: the next token's id, -100 at the end), because the
token a position predicts may sit on the next rank: each rank's loss then needs only its own logits.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from zeroengine import comm


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels[:, 1:]`` with -100 appended: what each position's logits predict."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:]


class UlyssesSPDataLoaderAdapter:
    """An iterator over ``dl``'s batches (dicts with ``input_ids``, ``position_ids`` and ``labels``, each
    ``[batch, seq]``), turned into this rank's pieces of the whole group's batches, one source rank at a time:
    ``labels`` become ``shift_labels``, every tensor is cut to columns ``[rank·seq/sp, (rank+1)·seq/sp)`` and
    returned contiguous on the CPU (``move_to_device`` them). Sequences must divide by sp (pad them with label -100)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next pass over the loader is a new epoch
            raise
        for key in ("input_ids", "position_ids", "labels"):
            if key not in batch:
                raise ValueError(f"UlyssesSPDataLoaderAdapter: the batch has no {key!r} (it needs input_ids, "
                                 f"labels and position_ids; has {sorted(batch)})")
        batches = self._gather(batch)
        for i, whole in enumerate(batches):
            length = whole["input_ids"].shape[1]
            if length % self.sp_world_size:
                raise ValueError(f"UlyssesSPDataLoaderAdapter: a sequence of {length} tokens (from rank {i} of the "
                                 f"sequence group) does not divide into {self.sp_world_size} equal pieces; pad it "
                                 f"to a multiple of {self.sp_world_size} (labels -100)")
            whole["shift_labels"] = shift_labels(whole.pop("labels"))
            piece = length // self.sp_world_size
            cut = slice(piece * self.sp_rank, piece * (self.sp_rank + 1))
            # contiguous: a column slice of a batch of several rows is not, and the loss views it flat (on a GPU
            # the copy to the CPU makes it so; on the CPU it is a no-op)
            self.micro_batches.append({key: value[:, cut].cpu().contiguous() if isinstance(value, torch.Tensor)
                                       else value for key, value in whole.items()})

    def _gather(self, batch: dict) -> list[dict]:
        """Every rank of the group's batch, in rank order (tensors ``[batch, seq]``; seq may differ by rank)."""
        length = batch["input_ids"].shape[1]
        lengths = comm.all_gather_object(int(length), group=self.sp_group)
        gathered = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                for i, v in enumerate(comm.all_gather_object(value, group=self.sp_group)):
                    gathered[i][key] = v
                continue
            if value.dim() != 2 or value.shape[1] != length:
                raise ValueError(f"UlyssesSPDataLoaderAdapter: batch[{key!r}] has shape {tuple(value.shape)}; every "
                                 f"tensor must be [batch, seq] with the input_ids' {length} tokens")
            rows, longest = value.shape[0], max(lengths)
            padded = torch.zeros(rows, longest, dtype=value.dtype, device=self.device)
            padded[:, :length] = value.to(self.device)
            everyone = torch.empty(self.sp_world_size, rows, longest, dtype=value.dtype, device=self.device)
            comm.all_gather(everyone.view(-1), padded.view(-1), group=self.sp_group)
            for i in range(self.sp_world_size):
                gathered[i][key] = everyone[i, :, :lengths[i]]
        return gathered


def move_to_device(item, device, criterion_func=None):
    """``item`` (tensors in lists, tuples and dicts, nested) on ``device``; with ``criterion_func``, the tensors
    it accepts are moved in place (DeepSpeed's ``deepspeed.runtime.utils.move_to_device``). Values that are not
    tensors are returned as they are."""
    if isinstance(item, (list, tuple)):
        moved = [move_to_device(v, device, criterion_func) for v in item]
        return tuple(moved) if isinstance(item, tuple) else moved
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, torch.Tensor):
        if criterion_func is not None and criterion_func(item):
            item.data = item.data.to(device)
            return item
        return item.to(device)
    return item
