"""The dataloader initialize() builds from training_data: each rank's share, DeepSpeed's drop_last default, a new
shuffle each pass (as DeepSpeedDataLoader), a clear refusal of what it cannot split; and RepeatingLoader."""
import argparse

import pytest
import torch

import zeroengine
from zeroengine.data import RepeatingLoader, build_dataloader


def sizes(loader):
    return [len(batch[0]) for batch in loader]


def test_last_partial_batch_is_kept_unless_dataloader_drop_last():
    data = torch.utils.data.TensorDataset(torch.arange(10))
    assert sizes(build_dataloader(data, 4)) == [4, 4, 2]  # DeepSpeed's default (dataloader_drop_last false)
    assert sizes(build_dataloader(data, 4, drop_last=True)) == [4, 4]


def test_ranks_get_equal_padded_shares_covering_every_sample():
    data = torch.utils.data.TensorDataset(torch.arange(11))
    shares = [[x.item() for (batch,) in build_dataloader(data, 4, rank=r, world_size=2) for x in batch]
              for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 6  # padded: no rank has a micro-batch the other lacks
    assert set(shares[0]) | set(shares[1]) == set(range(11))


def test_deepspeeds_data_sampler_set_epoch_reshuffles():
    loader = build_dataloader(torch.utils.data.TensorDataset(torch.arange(32)), 32)
    assert loader.data_sampler is loader.sampler  # DeepSpeedDataLoader's attribute, for its epoch idiom
    epochs = []
    for epoch in range(2):
        loader.data_sampler.set_epoch(epoch)
        epochs.append([x.item() for (batch,) in loader for x in batch])
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(32)) and epochs[0] != epochs[1]


def passes(loader, count):
    """The sample order of ``count`` passes over ``loader``, as a training loop without set_epoch reads it."""
    return [[x.item() for (batch,) in loader for x in batch] for _ in range(count)]


def test_each_pass_is_a_new_epoch_with_disjoint_shares_covering_the_data():
    data = torch.utils.data.TensorDataset(torch.arange(24))
    ranks = [passes(build_dataloader(data, 4, rank=r, world_size=2), 3) for r in range(2)]
    for epoch in range(3):
        shares = [set(ranks[r][epoch]) for r in range(2)]
        assert len(ranks[0][epoch]) == len(ranks[1][epoch]) == 12
        assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(24)), epoch
    for r in range(2):  # a new order each pass, without the loop calling set_epoch
        assert len({tuple(order) for order in ranks[r]}) == 3, r


def test_the_order_is_the_seeds_and_the_epochs_only():
    data = torch.utils.data.TensorDataset(torch.arange(24))
    again = [passes(build_dataloader(data, 4, rank=r, world_size=2), 3) for r in range(2)]
    assert again == [passes(build_dataloader(data, 4, rank=r, world_size=2), 3) for r in range(2)]
    other_seed = [passes(build_dataloader(data, 4, rank=r, world_size=2, seed=1), 3) for r in range(2)]
    assert other_seed != again
    # the same as DistributedSampler gives for that seed and epoch: what a DeepSpeed loop with set_epoch reads
    for epoch in range(3):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, seed=0)
        sampler.set_epoch(epoch)
        assert again[1][epoch] == list(sampler)


def test_an_epoch_the_loop_sets_is_the_one_read():
    data = torch.utils.data.TensorDataset(torch.arange(16))
    automatic = passes(build_dataloader(data, 4), 3)
    chosen = build_dataloader(data, 4)
    explicit = []
    for epoch in range(3):  # DeepSpeed's idiom: the same epochs as the loader counts itself
        chosen.data_sampler.set_epoch(epoch)
        explicit += passes(chosen, 1)
    assert explicit == automatic
    chosen.data_sampler.set_epoch(0)  # going back is honoured too, and counting goes on from there
    assert passes(chosen, 2) == automatic[:2]


def test_repeating_loader_restarts_a_loader_with_a_new_epoch_each_pass():
    data = torch.utils.data.TensorDataset(torch.arange(12))
    plain = torch.utils.data.DataLoader(data, batch_size=4, sampler=torch.utils.data.DistributedSampler(
        data, num_replicas=1, rank=0, seed=0))
    for loader in (plain, build_dataloader(data, 4)):  # a DistributedSampler's epoch, or the loader's own
        repeating = RepeatingLoader(loader)
        assert iter(repeating) is repeating
        read = [x.item() for _ in range(9) for x in next(repeating)[0]]
        epochs = [read[i:i + 12] for i in range(0, 36, 12)]
        assert all(sorted(e) == list(range(12)) for e in epochs) and len({tuple(e) for e in epochs}) == 3
        assert epochs == passes(build_dataloader(data, 4), 3) and repeating.epoch == 2
    batches = RepeatingLoader([1, 2])
    assert [next(batches) for _ in range(5)] == [1, 2, 1, 2, 1]  # no sampler: the same again
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))


def test_repeating_loader_is_deepspeeds_name_for_it():
    from zeroengine.integrations.ds_compat.runtime.dataloader import RepeatingLoader as runtime_name
    from zeroengine.integrations.ds_compat.utils import RepeatingLoader as utils_name

    assert utils_name is runtime_name is RepeatingLoader


def test_iterable_dataset_is_refused_by_name():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    with pytest.raises(TypeError, match="IterableDataset \\(Stream\\).*cannot split"):
        build_dataloader(Stream(), 2, rank=0, world_size=2)


def test_config_in_args_and_config_argument_together_is_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 2}')
    args = argparse.Namespace(deepspeed_config=str(path), zeroengine_config=str(path))
    with pytest.raises(zeroengine.ConfigError, match="two configs given"):
        zeroengine.initialize(args=args, model=torch.nn.Linear(2, 2), config={"train_batch_size": 6},
                              dist_init_required=False)
