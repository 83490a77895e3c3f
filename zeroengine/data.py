"""The distributed training dataloader ``initialize()`` returns when given ``training_data``."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


def build_dataloader(dataset, micro_batch_size: int, collate_fn=None, rank: int = 0, world_size: int = 1,
                     shuffle: bool = True, seed: int = 0) -> DataLoader:
    """Each rank reads its own 1/world_size of the data, ``micro_batch_size`` samples at a time.

    ``drop_last`` keeps every rank's micro-batch the same size, which the
    gradient average across ranks assumes. Call ``loader.sampler.set_epoch(e)``
    each epoch for a new shuffle, as with any DistributedSampler.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate_fn)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=True)
