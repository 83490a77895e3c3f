"""The distributed training dataloader ``initialize()`` returns when given ``training_data``."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


def build_dataloader(dataset, micro_batch_size: int, collate_fn=None, rank: int = 0, world_size: int = 1,
                     shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> DataLoader:
    """Each rank reads its own 1/world_size of the data, ``micro_batch_size`` samples at a time.

    As DeepSpeed's loader: the sampler pads the dataset (repeating samples) so that every rank gets the
    same number of samples, and so the same number of micro-batches (a rank with one batch more would
    wait in a collective the others never join); ``drop_last`` (the config's ``dataloader_drop_last``)
    drops the last micro-batch when it is smaller than ``micro_batch_size``. Call
    ``loader.sampler.set_epoch(e)`` (or DeepSpeed's ``loader.data_sampler.set_epoch(e)``) each epoch for a
    new shuffle, as with any DistributedSampler.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        # It cannot be indexed, so no sampler can give each rank its share; every rank would read it all.
        raise TypeError(f"initialize(training_data=...) got an IterableDataset ({type(dataset).__name__}), which "
                        "zeroengine cannot split across ranks; build your own DataLoader that yields this rank's "
                        "share (e.g. with torch.utils.data.get_worker_info and the rank), or pass a map-style "
                        "Dataset")
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                        drop_last=drop_last)
    loader.data_sampler = sampler  # DeepSpeedDataLoader's name for it: loader.data_sampler.set_epoch(e)
    return loader
