"""The distributed training dataloader ``initialize()`` returns when given ``training_data``, and
:class:`RepeatingLoader` (DeepSpeed's ``deepspeed.utils.RepeatingLoader``) for loops that count steps, not epochs.

The loader's position (epoch, seed, samples of the epoch's order consumed) is part of every checkpoint
(``state_dict``), and a loaded one continues its pass where it stopped: a killed and restarted run trains the
samples an uninterrupted run trains, and at another world size the rest of the epoch's order is shared out
among the new ranks, so no sample is repeated or skipped.
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, DistributedSampler


class EpochSampler(DistributedSampler):
    """A DistributedSampler that notes whether its epoch was chosen (``set_epoch``) since the loader's last pass
    began, so :class:`TrainingDataLoader` advances it only when the script did not; and that can begin a pass
    ``start`` samples into its epoch's order (a resumed pass: the rest is shared out among the ranks as
    DistributedSampler shares a whole epoch, padded the same way, so at the same world size every rank gets
    exactly the samples it would have got)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_chosen = False
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_chosen = True

    def _share(self) -> tuple[int, int]:
        """(samples per rank, padded end of the order) of the pass from ``start``."""
        per_rank = math.ceil(max(len(self.dataset) - self.start, 0) / self.num_replicas)
        return per_rank, self.start + per_rank * self.num_replicas

    def __iter__(self):
        if not self.start:
            return super().__iter__()
        size = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(size))
        _, end = self._share()
        if end > size:  # padded by repeating the epoch's order from its start, as DistributedSampler pads
            order += (order * math.ceil((end - size) / size))[:end - size]
        return iter(order[self.start + self.rank:end:self.num_replicas])

    def __len__(self) -> int:
        return self._share()[0] if self.start else super().__len__()


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
        self.taken = 0  # micro-batches of the current pass handed out
        self._resume: dict | None = None  # a loaded position, for the next pass
        self.resumed_at: int | None = None  # the position the current pass resumed from (None: a whole pass)

    def __iter__(self):
        sampler = self.sampler
        resume, self._resume = self._resume, None
        if resume is not None and (not sampler.epoch_chosen or sampler.epoch == resume["epoch"]):
            sampler.epoch, sampler.start = resume["epoch"], resume["consumed"]  # the saved pass, from its place
            self.resumed_at = resume["consumed"]
        else:
            self.resumed_at = None
            if self.passes and not sampler.epoch_chosen:
                sampler.epoch += 1  # (not set_epoch: that would read as the script's choice)
            sampler.start = 0
        sampler.epoch_chosen = False
        self.passes += 1
        self.taken = 0
        return self._counted(super().__iter__())

    def _counted(self, batches):
        for batch in batches:
            self.taken += 1
            yield batch

    def skipped_twice_warning(self, per_step: int) -> str | None:
        """Called at the engine's first forward after a resumed pass began: a script that took more than one
        step's micro-batches before it is skipping what the checkpointed run consumed (DeepSpeed's habit:
        DeepSpeed's loader restarts its epoch), which the resumed loader has skipped already."""
        if self.resumed_at is None or self.taken <= per_step:
            return None
        return (f"the training loader resumed at the checkpoint's position ({self.resumed_at} samples into epoch "
                f"{self.sampler.epoch}), and this script then took {self.taken} micro-batches before its first "
                f"forward: if it skips what the checkpointed run consumed (DeepSpeed's loader starts its epoch "
                f"over), the data is skipped twice. Drop the skipping, or set checkpoint.resume_data_position: "
                f"false to start the epoch over as DeepSpeed does")

    def state_dict(self) -> dict:
        """Where the loader is: the epoch, its seed, and how many samples of the epoch's order (over all ranks)
        the current pass has handed out; saved in every checkpoint."""
        sampler = self.sampler
        consumed = min(sampler.start + self.taken * self.batch_size * sampler.num_replicas,
                       sampler._share()[1])
        return {"epoch": sampler.epoch, "seed": sampler.seed, "shuffle": sampler.shuffle, "passes": self.passes,
                "consumed": consumed if self.passes else 0, "dataset_size": len(self.dataset)}

    def check_state(self, state: dict) -> None:
        """Refuse (ValueError) a position saved over other data: where to continue would be unknown."""
        if state["dataset_size"] != len(self.dataset) or state["seed"] != self.sampler.seed \
                or state["shuffle"] != self.sampler.shuffle:
            raise ValueError(f"the checkpoint's data position is for {state['dataset_size']} samples (seed "
                             f"{state['seed']}, shuffle {state['shuffle']}) and this loader has "
                             f"{len(self.dataset)} (seed {self.sampler.seed}, shuffle {self.sampler.shuffle}): "
                             "the data changed, so where to continue is unknown")

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (saved at any world size): the next pass is the saved one, from the first
        sample not yet handed out; a pass that was over goes on to the next epoch, as it would have."""
        self.check_state(state)
        self.sampler.epoch, self.sampler.epoch_chosen = state["epoch"], False
        self.passes = state["passes"]
        unfinished = state["passes"] > 0 and state["consumed"] < state["dataset_size"]
        self._resume = {"epoch": state["epoch"], "consumed": state["consumed"]} if unfinished else None


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
