"""The distributed training dataloader ``initialize()`` returns when given ``training_data``, and
:class:`RepeatingLoader` (DeepSpeed's ``deepspeed.utils.RepeatingLoader``) for loops that count steps, not epochs."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


class EpochSampler(DistributedSampler):
    """A DistributedSampler that notes whether its epoch was chosen (``set_epoch``) since the loader's last pass
    began, so :class:`TrainingDataLoader` advances it only when the script did not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_chosen = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_chosen = True


class TrainingDataLoader(DataLoader):
    """A DataLoader whose every new pass is the next epoch of its sampler: a new shuffle each epoch, as
    DeepSpeedDataLoader gives, without the script calling ``set_epoch``.

    The first pass is the sampler's epoch (0); each later pass is one more than the previous, unless the script
    chose one with ``loader.sampler.set_epoch(e)`` (DeepSpeed's ``loader.data_sampler.set_epoch(e)``) since: then
    that one. So a loop calling ``set_epoch(epoch)`` each epoch gets exactly its epochs, and one that does not
    still reshuffles. Every rank counts its own passes, so ranks that run the same loop agree on the epoch (the
    shuffle depends only on the seed and the epoch) and their shares stay disjoint."""

    sampler: EpochSampler

    def __init__(self, dataset, *args, sampler: EpochSampler, **kwargs):
        super().__init__(dataset, *args, sampler=sampler, **kwargs)
        self.data_sampler = sampler  # DeepSpeedDataLoader's name for it: loader.data_sampler.set_epoch(e)
        self.passes = 0  # passes begun (iter() calls)

    def __iter__(self):
        sampler = self.sampler
        if self.passes and not sampler.epoch_chosen:
            sampler.epoch += 1  # (not set_epoch: that would read as the script's choice)
        sampler.epoch_chosen = False
        self.passes += 1
        return super().__iter__()


def build_dataloader(dataset, micro_batch_size: int, collate_fn=None, rank: int = 0, world_size: int = 1,
                     shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> TrainingDataLoader:
    """Each rank reads its own 1/world_size of the data, ``micro_batch_size`` samples at a time, in a new order
    each pass (:class:`TrainingDataLoader`).

    As DeepSpeed's loader: the sampler pads the dataset (repeating samples) so that every rank gets the
    same number of samples, and so the same number of micro-batches (a rank with one batch more would
    wait in a collective the others never join); ``drop_last`` (the config's ``dataloader_drop_last``)
    drops the last micro-batch when it is smaller than ``micro_batch_size``.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        # It cannot be indexed, so no sampler can give each rank its share; every rank would read it all.
        raise TypeError(f"initialize(training_data=...) got an IterableDataset ({type(dataset).__name__}), which "
                        "zeroengine cannot split across ranks; build your own DataLoader that yields this rank's "
                        "share (e.g. with torch.utils.data.get_worker_info and the rank), or pass a map-style "
                        "Dataset")
    sampler = EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    return TrainingDataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                              drop_last=drop_last)


class RepeatingLoader:
    """An endless iterator over ``loader``: when a pass ends, the next begins (DeepSpeed's
    ``deepspeed.utils.RepeatingLoader``, for ``engine.train_batch(iter)`` loops that count steps, not epochs).

    Each new pass is a new epoch: a sampler with ``set_epoch`` (a DistributedSampler) is moved on by one before
    it, so the order changes as it would in an epoch loop (the loader ``initialize`` returns would do so itself;
    this sets the same epoch)."""

    def __init__(self, loader):
        self.loader = loader
        self.epoch = getattr(getattr(loader, "sampler", None), "epoch", 0)  # of the pass under way
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            sampler = getattr(self.loader, "sampler", None)
            self.epoch = getattr(sampler, "epoch", self.epoch) + 1
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader ends here too, rather than looping forever
