"""offload_optimizer.ratio: which buckets are offloaded (whole buckets, a prefix of the layout, nearest)."""
import logging

import pytest

from zeroengine.config import ConfigError, load_config
from zeroengine.offload import place_buckets


@pytest.mark.parametrize("ratio,expected", [(1.0, {0, 1, 2, 3}), (0.0, set()), (0.5, {0, 1}), (0.3, {0}),
                                            (0.4, {0, 1}), (0.85, {0, 1, 2})])
def test_equal_buckets_round_to_the_nearest_prefix(ratio, expected):
    placement = place_buckets([100, 100, 100, 100], ratio)
    assert placement.host_buckets == expected
    assert placement.host_numel == 100 * len(expected) and placement.total_numel == 400
    assert placement.fraction == len(expected) / 4
    assert all(placement.on_host(b) == (b in expected) for b in range(4))


def test_unequal_buckets_stop_where_the_next_one_would_overshoot_more():
    # target 0.5 * 1000 = 500: 300 + 600 would reach 900 (400 over) while 300 is 200 under -> stop at 300
    assert place_buckets([300, 600, 100], 0.5).host_buckets == {0}
    # target 0.7 * 1000 = 700: 300 + 600 = 900 (200 over) beats 300 (400 under)
    assert place_buckets([300, 600, 100], 0.7).host_buckets == {0, 1}


def test_no_buckets_counts_as_fully_offloaded():
    placement = place_buckets([], 0.5)
    assert placement.host_buckets == frozenset() and placement.fraction == 1.0


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_out_of_range_ratio_is_refused(ratio):
    with pytest.raises(ValueError, match="ratio"):
        place_buckets([10], ratio)
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 4, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": ratio}}})
    assert info.value.key_path == "zero_optimization.offload_optimizer.ratio"


def test_config_ratio_loads_for_every_sharded_stage():
    for stage in (1, 2, 3):
        cfg = load_config({"train_batch_size": 4, "zero_optimization": {
            "stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}})
        assert cfg.zero_optimization.offload_optimizer.ratio == 0.25


def test_a_split_far_from_the_ratio_is_a_warning_naming_the_bucket_size(caplog):
    with caplog.at_level(logging.INFO, logger="zeroengine.offload.placement"):
        place_buckets([100] * 3, 0.5)  # 2/3 offloaded: 0.17 away from what was asked
        place_buckets([100] * 10, 0.5)  # exact
    far, close = caplog.records
    assert far.levelno == logging.WARNING and "reduce_bucket_size" in far.getMessage()
    assert "0.667" in far.getMessage()
    assert close.levelno == logging.INFO and "0.500 of the optimizer state" in close.getMessage()
