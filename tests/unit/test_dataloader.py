"""The dataloader initialize() builds from training_data: each rank's share, DeepSpeed's drop_last default,
and a clear refusal of what it cannot split."""
import argparse

import pytest
import torch

import zeroengine
from zeroengine.data import build_dataloader


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
